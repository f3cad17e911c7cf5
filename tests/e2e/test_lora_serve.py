"""LoRA through a real omni-serve (issue #29) with the official openai client: the base and three
adapters in one concurrent load equal transformers + peft token for token; /v1/models lists each
adapter with its parent; runtime load/unload (only with --allow-runtime-lora-updating); an unknown
or unloaded adapter is a 404 naming it; 8 adapters through --max-loras 2."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json

import openai
import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ServeProcess
from omnirelay.deploy.builders.lora import build_tiny_lora

peft = pytest.importorskip("peft")

MODEL = "tiny-llm"
PROMPTS = ["Hi!", "What is the capital of France?", "Write one sentence about the sea and the sky.",
           "Count from one to five."]
NEW_TOKENS = 24
RECIPES = {"a1": (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
           "a2": (4, ("q_proj", "v_proj"), False), "a3": (16, ("gate_proj", "up_proj", "down_proj", "o_proj"), True)}


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    out = {name: str(build_tiny_lora(tiny_model, root / name, rank=rank, targets=targets, seed=seed, use_rslora=rs))
           for seed, (name, (rank, targets, rs)) in enumerate(RECIPES.items(), 1)}
    for i in range(8):   # for the eviction test and runtime loading
        out[f"m{i}"] = str(build_tiny_lora(tiny_model, root / f"m{i}", rank=4, targets=("q_proj", "v_proj"),
                                           seed=10 + i))
    return out


@pytest.fixture(scope="module")
def peft_greedy(tiny_model):
    """``greedy(adapter_dir or None, content, n)``: transformers (+ peft, unmerged) greedy tokens of a
    one-message chat."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    models: dict = {}

    def greedy(adapter: str | None, content: str, n: int = NEW_TOKENS) -> list[int]:
        if adapter not in models:
            hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
            # ignore_eos as the requests ask: no EOS stop (min_new_tokens would mask EOS out instead)
            hf.generation_config.eos_token_id = None
            models[adapter] = hf if adapter is None else peft.PeftModel.from_pretrained(hf, adapter).eval()
        text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = models[adapter].generate(input_ids=ids, max_new_tokens=n, do_sample=False)
        return out[0, ids.shape[1]:].tolist()

    return greedy


@pytest.fixture(scope="module")
def lora_server(tiny_model, adapters, tmp_path_factory):
    modules = ["a1=" + adapters["a1"], "a2=" + adapters["a2"],
               json.dumps({"name": "a3", "path": adapters["a3"], "base_model_name": MODEL}),
               *(f"m{i}={adapters[f'm{i}']}" for i in range(6))]
    log_path = str(tmp_path_factory.mktemp("serve") / "omni-serve.log")
    serve = ServeProcess(tiny_model, "--served-model-name", MODEL, "--log-level", "WARNING", "--enable-lora",
                         *(arg for m in modules for arg in ("--lora-modules", m)), "--max-loras", "2",
                         "--max-lora-rank", "16", "--allow-runtime-lora-updating", log_path=log_path)
    yield serve
    serve.stop()


def _run(server, jobs: list[tuple[str, str]], n: int = NEW_TOKENS) -> list[list[int]]:
    """Every ``(model, content)`` at once through the openai client: each answer's token ids."""
    async def one(aclient, model, content):
        response = await aclient.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=n,
            extra_body={"return_token_ids": True, "ignore_eos": True})
        assert response.model == model
        return response.choices[0].model_extra["token_ids"]

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, m, c) for m, c in jobs))

    return asyncio.run(run_all())


def test_base_and_three_adapters_in_one_load_equal_peft(lora_server, adapters, peft_greedy):
    jobs = [(name, content) for content in PROMPTS for name in (MODEL, *RECIPES)]
    for (name, content), tokens in zip(jobs, _run(lora_server, jobs)):
        assert tokens == peft_greedy(adapters.get(name), content), (name, content)
    listed = {m.id: m for m in openai.OpenAI(base_url=lora_server.url + "/v1", api_key="unused").models.list()}
    assert listed[MODEL].model_extra.get("parent") is None
    for name in (*RECIPES, *(f"m{i}" for i in range(6))):
        assert listed[name].model_extra["parent"] == MODEL


def test_six_adapters_through_two_slots(lora_server, adapters, peft_greedy):
    jobs = [(f"m{i}", PROMPTS[i % 2]) for i in range(6)] * 2
    for (name, content), tokens in zip(jobs, _run(lora_server, jobs, n=8)):
        assert tokens == peft_greedy(adapters[name], content, 8), name


def test_runtime_load_and_unload(lora_server, adapters, peft_greedy):
    """Loaded and unloaded while other adapters' requests are running: none of those fails."""
    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key="unused", max_retries=0)
    load_jobs = [(name, content) for content in PROMPTS[:2] for name in (MODEL, "a1", "a2")]
    background = concurrent.futures.ThreadPoolExecutor(1)
    under_load = background.submit(_run, lora_server, load_jobs, 16)
    with pytest.raises(openai.NotFoundError, match="'m7'"):
        client.chat.completions.create(model="m7", messages=[{"role": "user", "content": "Hi!"}], max_tokens=2)
    load = requests.post(lora_server.url + "/v1/load_lora_adapter",
                         json={"lora_name": "m7", "lora_path": adapters["m7"]}, timeout=30)
    assert load.status_code == 200, load.text
    assert _run(lora_server, [("m7", PROMPTS[0])], n=8) == [peft_greedy(adapters["m7"], PROMPTS[0], 8)]
    bad = requests.post(lora_server.url + "/v1/load_lora_adapter",
                        json={"lora_name": "m8", "lora_path": str(lora_server.log_path)}, timeout=30)
    assert bad.status_code == 400 and "'m8'" in bad.text
    gone = requests.post(lora_server.url + "/v1/unload_lora_adapter", json={"lora_name": "m7"}, timeout=30)
    assert gone.status_code == 200, gone.text
    with pytest.raises(openai.NotFoundError, match="'m7'"):
        client.chat.completions.create(model="m7", messages=[{"role": "user", "content": "Hi!"}], max_tokens=2)
    again = requests.post(lora_server.url + "/v1/unload_lora_adapter", json={"lora_name": "m7"}, timeout=30)
    assert again.status_code == 404 and "'m7'" in again.text
    for (name, content), tokens in zip(load_jobs, under_load.result(timeout=300)):
        assert tokens == peft_greedy(adapters.get(name), content, 16), name
    background.shutdown()


def test_runtime_routes_need_the_flag(server):
    """The plain server (no LoRA flags): no adapter routes, and /v1/models is as before."""
    for route in ("load_lora_adapter", "unload_lora_adapter"):
        response = requests.post(f"{server.url}/v1/{route}", json={"lora_name": "x", "lora_path": "/tmp"}, timeout=30)
        assert response.status_code in (404, 405), response.text
    models = requests.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert all("parent" not in m for m in models)


@pytest.mark.slow   # two groups of two ranks on 2 shared cores: about two minutes
@pytest.mark.parametrize("parallel", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_base_and_three_adapters_in_parallel_groups_equal_peft(tiny_model, adapters, peft_greedy, tmp_path, parallel):
    """The same load with prefill and decode each a group of two ranks. Tensor parallel: every rank
    holds its shard of each adapter (B's rows of q/k/v/gate/up, A's columns of o/down); pipeline
    parallel: its layers' part. Each loads the adapter into the slot rank 0 chose; with 1 slot the
    three adapters also take turns in it (the ranks follow rank 0)."""
    modules = [arg for name in RECIPES for arg in ("--lora-modules", f"{name}={adapters[name]}")]
    with ServeProcess(tiny_model, "--served-model-name", MODEL, "--log-level", "WARNING",
                      parallel, "2", "--enable-lora", *modules, "--max-loras", "1",
                      "--max-lora-rank", "16", log_path=str(tmp_path / "omni-serve.log")) as server:
        jobs = [(name, content) for content in PROMPTS for name in (MODEL, *RECIPES)]
        for (name, content), tokens in zip(jobs, _run(server, jobs)):
            assert tokens == peft_greedy(adapters.get(name), content), (name, content)
