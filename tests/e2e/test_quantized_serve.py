"""Quantized models served end to end, through the official ``openai`` client: an llm-compressor W8A8
checkpoint under ``omni-serve`` (int8 GEMMs in prefill and decode, the KV hand-off unchanged), online
``--quantization int8`` of a float checkpoint, and a Qwen2.5-Omni thinker quantized at load answering
with audio (its encoders and talker stay in float).

Each answer is checked token for token against the same quantized model run in this process
(:class:`LlamaModel`, greedy, whole-prompt forwards): the served path adds the paged KV, the hand-off
and batching, none of which may change a token.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
import yaml
from transformers import AutoTokenizer

from omnirelay.deploy.builders.omni import build_tiny_omni
from omnirelay.deploy.builders.quantized import build_quantized
from omnirelay.workers.llm import quantization
from omnirelay.workers.llm.models.llama import LlamaModel

from conftest import ServeProcess
from media_support import pipeline_cluster, wav_samples
from repo_paths import REPO_ROOT

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not quantization.int8_available(torch.device("cpu")),
                                 reason="this torch build has no fbgemm int8 GEMM")]

MAX_TOKENS = 10
QUESTION = "Write one sentence about the sea and the sky."


def _greedy(model: LlamaModel, ids: list[int], count: int, stop: tuple[int, ...] = ()) -> list[int]:
    out: list[int] = []
    for _ in range(count):
        logits, _ = model.prefill(ids + out)
        out.append(int(logits.float().argmax()))
        if out[-1] in stop:
            break
    return out


def _chat_ids(path: str, messages: list[dict]) -> list[int]:
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("how", ["w8a8-checkpoint", "online-int8"])
def test_a_quantized_model_answers_as_it_does_in_process(tiny_model, tmp_path, how):
    torch.set_num_threads(1)
    if how == "w8a8-checkpoint":
        path, extra = str(build_quantized(tiny_model, tmp_path / "w8a8", scheme="W8A8")), []
        model = LlamaModel(path, torch.float32)
    else:
        path, extra = tiny_model, ["--quantization", "int8"]
        model = LlamaModel(path, torch.float32, quantization="int8")
    messages = [{"role": "user", "content": QUESTION}]
    expected = _greedy(model, _chat_ids(path, messages), MAX_TOKENS, model.config.eos_token_ids)
    with ServeProcess(path, "--served-model-name", "q", "--log-level", "INFO", *extra,
                      log_path=str(tmp_path / "serve.log")) as serve:
        import openai
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.chat.completions.create(model="q", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                                extra_body={"return_token_ids": True})
        streamed = client.chat.completions.create(model="q", messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        log = serve.output()
    assert answer.choices[0].token_ids == expected
    assert text == answer.choices[0].message.content
    assert "int8" in log and "linear weights" in log   # each LLM worker says what its linears run


@pytest.mark.slow
def test_an_omni_thinker_quantized_at_load_answers_with_audio(tmp_path):
    """Qwen2.5-Omni with ``quantization: int8`` in its prefill and decode stages: the spoken answer's
    transcript is the int8 thinker's greedy reply, and the talker speaks it."""
    torch.set_num_threads(1)
    omni = str(build_tiny_omni(tmp_path / "tiny-omni", seed=0))
    pipeline = yaml.safe_load((REPO_ROOT / "deploy" / "pipelines" / "omni.yaml").read_text())
    for stage in pipeline["stages"]:
        if stage["role"] in ("prefill", "decode"):
            stage.setdefault("engine_args", {})["quantization"] = "int8"
    pipeline_path = tmp_path / "omni-int8.yaml"
    pipeline_path.write_text(yaml.safe_dump(pipeline))
    messages = [{"role": "user", "content": "Say hello to the world"}]
    thinker = LlamaModel(omni, torch.float32, quantization="int8")
    expected = _greedy(thinker, _chat_ids(omni, messages), 8, thinker.config.eos_token_ids)
    (tmp_path / "logs").mkdir()
    with pipeline_cluster(omni, str(tmp_path / "logs"), "tiny-omni", str(pipeline_path),
                          ("encode", "prefill", "decode", "generate"), start_timeout=180) as cluster:
        import openai
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        answer = client.chat.completions.create(
            model="tiny-omni", messages=messages, modalities=["text", "audio"], max_tokens=8, temperature=0,
            seed=1234, audio={"voice": "Ethan", "format": "wav"}, extra_body={"max_audio_tokens": 16})
    logs = {path.name: path.read_text() for path in (tmp_path / "logs").iterdir()}
    quantized_roles = sorted(name for name, text in logs.items() if "linear weights int8" in text)
    assert len(quantized_roles) == 2 and all("prefill" in n or "decode" in n for n in quantized_roles), quantized_roles
    audio = answer.choices[0].message.audio
    tok = AutoTokenizer.from_pretrained(omni)
    assert audio.transcript == tok.decode(expected, skip_special_tokens=True)
    samples = wav_samples(base64.b64decode(audio.data), 24000)
    assert samples.shape == (16 * 480,)                        # 16 codes, 2 mel frames each, 240 samples a frame
    assert np.sqrt(np.mean((samples / 32767.0) ** 2)) > 0.01   # not silent
