"""LoRA keys of the stage-pipeline YAML (issue #29): ``enable_lora``, ``lora_modules``, ``max_loras``,
``max_lora_rank`` and ``max_cpu_loras`` in a prefill or decode stage's ``engine_args`` mean what
vLLM's flags of the same names mean.

* Parsing: the keys give the options the flags give (``omnirelay/lora_modules.py``), in both
  entry forms; bad values, LoRA on a stage that runs no LLM, a key without ``enable_lora: true``,
  one adapter name with two directories are errors naming the entry; vLLM-Omni's legacy format keeps
  the keys; the gateway serves every LoRA stage's adapters under the pipeline's model.
* Through a real omni-serve given only the YAML (no LoRA flag): the base and an adapter answer
  as transformers + peft does, and ``/v1/models`` lists the adapter with the base as parent.
"""

from __future__ import annotations

import argparse
import json

import openai
import pytest
import yaml

from conftest import ServeProcess
from omnirelay import lora_modules
from omnirelay.pipeline import PipelineError, parse_pipeline

MODEL = "tiny-llm"


def pipeline(prefill: dict | None = None, decode: dict | None = None, generate: dict | None = None) -> dict:
    stages = [{"name": "prefill", "role": "prefill", "engine_args": prefill or {}},
              {"name": "decode", "role": "decode", "engine_args": decode or {}}]
    if generate is not None:
        stages.append({"name": "generate", "role": "generate", "engine_args": generate})
    return {"stages": stages, "connectors": {"kv": {"type": "shared_memory"}},
            "edges": [{"from": "prefill", "to": "decode", "connector": "kv"}]}


def flags(*argv: str) -> lora_modules.LoraOptions | None:
    parser = argparse.ArgumentParser()
    lora_modules.add_arguments(parser)
    return lora_modules.options_from_args(parser.parse_args(list(argv)))


def test_the_keys_equal_the_flags():
    keys = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4,
            "lora_modules": ["a1=/ad/a1", {"name": "a2", "path": "/ad/a2", "base_model_name": MODEL}]}
    parsed = parse_pipeline(pipeline(prefill=keys, decode=keys))
    expected = flags("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "4",
                     "--lora-modules", "a1=/ad/a1", "--lora-modules",
                     json.dumps({"name": "a2", "path": "/ad/a2", "base_model_name": MODEL}))
    assert parsed.stages[0].lora == parsed.stages[1].lora == expected
    # vLLM's own form: several adapters after one --lora-modules
    assert flags("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "4", "--lora-modules",
                 "a1=/ad/a1", json.dumps({"name": "a2", "path": "/ad/a2", "base_model_name": MODEL})) == expected
    # The defaults too: enable_lora alone is --enable-lora alone.
    assert parse_pipeline(pipeline(decode={"enable_lora": True})).stages[1].lora == flags("--enable-lora")
    assert parse_pipeline(pipeline(prefill={"enable_lora": False})).stages[0].lora is None
    assert parse_pipeline(pipeline()).stages[0].lora is None and parse_pipeline(pipeline()).lora_options("m") is None


def test_the_gateway_serves_every_lora_stage_adapter_under_the_pipeline_model():
    parsed = parse_pipeline(pipeline(prefill={"enable_lora": True, "lora_modules": ["a1=/ad/a1"], "max_lora_rank": 8},
                                     decode={"enable_lora": True, "lora_modules": ["a1=/ad/a1", "a2=/ad/a2"],
                                             "max_lora_rank": 32}))
    options = parsed.lora_options("served")
    assert options.modules_for("served", first=False) == {"a1": "/ad/a1", "a2": "/ad/a2"}
    assert options.modules_for("other", first=True) == {} and options.max_lora_rank == 32


@pytest.mark.parametrize("stages, where", [
    (dict(prefill={"enable_lora": "yes"}), "stages[0].engine_args.enable_lora"),
    (dict(prefill={"max_loras": 2}), "stages[0].engine_args.max_loras: needs enable_lora: true"),
    (dict(decode={"enable_lora": False, "lora_modules": ["a=/a"]}), "stages[1].engine_args.lora_modules: needs"),
    (dict(decode={"enable_lora": True, "max_loras": 0}), "stages[1].engine_args.max_loras: must be an integer >= 1"),
    (dict(decode={"enable_lora": True, "max_cpu_loras": True}), "stages[1].engine_args.max_cpu_loras"),
    (dict(decode={"enable_lora": True, "max_lora_rank": "16"}), "stages[1].engine_args.max_lora_rank"),
    (dict(decode={"enable_lora": True, "lora_modules": "a=/a"}), "stages[1].engine_args.lora_modules: expected a list"),
    (dict(decode={"enable_lora": True, "lora_modules": ["a"]}), "stages[1].engine_args.lora_modules[0]: expected"),
    (dict(decode={"enable_lora": True, "lora_modules": [{"name": "a"}]}), "stages[1].engine_args.lora_modules[0]"),
    (dict(decode={"enable_lora": True, "lora_modules": [3]}), "stages[1].engine_args.lora_modules[0]"),
    (dict(decode={"enable_lora": True, "lora_modules": ["a=/a", "a=/b"]}), "a name is given twice"),
    (dict(prefill={"enable_lora": True, "lora_modules": ["a=/a"]}, decode={"enable_lora": True, "lora_modules": ["a=/b"]}),
     "stage 'decode': LoRA adapter 'a' is /b, but /a in stage 'prefill'"),
    (dict(generate={"enable_lora": True}), "stages[2].engine_args.enable_lora: only prefill and decode"),
])
def test_bad_keys_are_errors_naming_the_entry(stages, where):
    with pytest.raises(PipelineError) as caught:
        parse_pipeline(pipeline(**stages))
    assert where in str(caught.value)


def test_the_legacy_format_keeps_the_keys():
    legacy = {"stage_args": [
        {"stage_id": 0, "engine_args": {"model_stage": "thinker", "enable_lora": True, "max_loras": 3,
                                        "lora_modules": ["a1=/ad/a1"]}}]}
    stages = [s for s in parse_pipeline(legacy).stages if s.role in ("prefill", "decode")]
    assert stages and all(s.lora == flags("--enable-lora", "--max-loras", "3", "--lora-modules", "a1=/ad/a1")
                          for s in stages)


def test_omni_serve_with_the_yaml_alone_serves_the_adapter(tiny_model, tmp_path):
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from omnirelay.deploy.builders.lora import build_tiny_lora

    adapter = str(build_tiny_lora(tiny_model, tmp_path / "a1", rank=4, targets=("q_proj", "v_proj", "down_proj"),
                                  seed=3))
    keys = {"enable_lora": True, "lora_modules": [f"a1={adapter}"], "max_loras": 1, "max_lora_rank": 8}
    doc = pipeline(prefill=keys, decode=keys)
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(doc))
    content, n = "Write one sentence about the sea.", 12
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok(tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                      add_generation_prompt=True), add_special_tokens=False, return_tensors="pt")["input_ids"]

    def reference(adapter_dir: str | None) -> list[int]:
        hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None   # as ignore_eos
        model = hf if adapter_dir is None else peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
        with torch.no_grad():
            return model.generate(input_ids=ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()

    with ServeProcess(tiny_model, "--served-model-name", MODEL, "--stage-configs-path", str(path),
                      "--log-level", "WARNING", log_path=str(tmp_path / "serve.log")) as serve:
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        listed = {m.id: m for m in client.models.list()}
        assert listed["a1"].model_extra["parent"] == MODEL
        for name, adapter_dir in ((MODEL, None), ("a1", adapter)):
            answer = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=n,
                extra_body={"return_token_ids": True, "ignore_eos": True})
            assert answer.choices[0].model_extra["token_ids"] == reference(adapter_dir), name
