"""Greedy parity with transformers through ``omni-serve`` and the official openai client: Qwen3
(its KV handed over layer by layer), Qwen3-MoE, and Qwen3-MoE on two ranks with expert parallelism
(4 prompts × 24 tokens each)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from omnirelay.deploy.builders.qwen3 import cached_qwen3
from omnirelay.workers.llm.models.llama import LlamaConfig

from conftest import ServeProcess, hf_chat_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

PROMPTS = ["Hi!", "What is the capital of France?", "Count from one to five.",
           "Tell me a short story about a cat, a dog and a very old tree."]
TOKENS = 24


def _layerwise_pipeline(tmp_path) -> str:
    path = tmp_path / "layerwise.yaml"
    path.write_text(json.dumps({   # YAML is a superset of JSON
        "stages": [{"name": "prefill", "role": "prefill", "engine_args": {"kv_transfer": "layerwise"}},
                   {"name": "decode", "role": "decode"}],
        "connectors": {"kv": {"type": "shared_memory", "options": {}}},
        "edges": [{"from": "prefill", "to": "decode", "connector": "kv"}]}))
    return str(path)


@pytest.mark.parametrize("kind", ["qwen3-layerwise", "qwen3-moe", "qwen3-moe-tp2-ep"])
def test_greedy_parity_through_omni_serve(kind, tmp_path):
    model = str(cached_qwen3(moe="moe" in kind))
    extra = {"qwen3-layerwise": ["--stage-configs-path", _layerwise_pipeline(tmp_path)],
             "qwen3-moe": [],
             "qwen3-moe-tp2-ep": ["--tensor-parallel-size", "2", "--enable-expert-parallel"]}[kind]
    eos = LlamaConfig.from_dir(Path(model)).eos_token_ids
    serve = ServeProcess(model, "--served-model-name", kind, *extra, log_path=str(tmp_path / "serve.log"))
    try:
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt in PROMPTS:
            answer = client.chat.completions.create(
                model=kind, messages=[{"role": "user", "content": prompt}], max_tokens=TOKENS, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
            tokens = answer.choices[0].model_extra["token_ids"]
            assert len(tokens) == TOKENS
            reference = hf_chat_greedy(model, prompt, TOKENS)
            assert tokens[:len(reference)] == reference, (prompt, tokens, reference)
            assert len(reference) == TOKENS or reference[-1] in eos   # shorter only by stopping at EOS
        if kind == "qwen3-moe-tp2-ep":
            assert len(serve.children) >= 6   # broker, gateway, 2 workers and one extra rank each
    finally:
        serve.stop()
