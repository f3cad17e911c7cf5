"""Helpers shared by the engine tests: prompts, the transformers reference, engine drivers."""

from __future__ import annotations

import os
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from omnirelay.connectors import create_connector
from omnirelay.workers.llm.decode import DecodeEngine, DecodeTask
from omnirelay.workers.kv.cache import PagedKVCache
from omnirelay.workers.llm.model_runner import LocalRunner, local_runner
from omnirelay.workers.llm.models.llama import LlamaModel
from omnirelay.workers.llm.prefill import PrefillEngine, PrefillTask
from omnirelay.workers.llm.requests import EngineStep, TokenOut
from omnirelay.request_params import TextParams

NEW_TOKENS = 16
GREEDY = TextParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SYSTEM = ("You are a careful assistant. Answer in short sentences, cite nothing, and never "
          "repeat the question back to the user. Keep every answer under fifty words.")
QUESTIONS = ["Hi!", "What is the capital of France?", "Write one sentence about the sea and the sky.",
             "Count from one to five.", "Tell me a short story about a cat, a dog and a very old tree.",
             "Why?"]


@pytest.fixture(scope="module")
def model(tiny_model):
    torch.set_num_threads(1)
    return LlamaModel(tiny_model)


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def reference(tiny_model):
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    memo: dict[tuple, list[int]] = {}

    def greedy(ids: list[int]) -> list[int]:
        if tuple(ids) not in memo:
            with torch.no_grad():
                out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False)
            memo[tuple(ids)] = out[0, len(ids):].tolist()
        return memo[tuple(ids)]

    return greedy


@pytest.fixture
def connector(tmp_path):
    conn = create_connector("shared_memory", {"shm_dir": str(tmp_path)})
    yield conn
    conn.close()


def shm_keys(directory) -> list[str]:
    """Published key entries of the shared-memory connector (symlinks; segments are plain files)."""
    return sorted(n for n in os.listdir(directory) if os.path.islink(os.path.join(directory, n)))


def chat_ids(tok, question: str, system: str | None = None) -> list[int]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def runner_for(model: LlamaModel, block_size: int = 16, kv_cache_bytes: int = 256 << 20) -> LocalRunner:
    """The engines take a ModelRunner: ``model`` with a local pool of ``kv_cache_bytes`` in blocks of
    ``block_size`` tokens (the worker's own default budget)."""
    return local_runner(model, block_size=block_size, budget_bytes=kv_cache_bytes)


def run_prefill(engine: PrefillEngine, prompts: list[list[int]], first: int = 0, max_steps: int = 200) -> dict:
    for i, ids in enumerate(prompts, first):
        engine.add(PrefillTask(f"r{i}", ids, GREEDY, time.time() + 60))
    return drain_prefill(engine, max_steps)


def drain_prefill(engine: PrefillEngine, max_steps: int = 200) -> dict:
    """Step until the engine holds nothing; each request's done TokenOut (its first token and
    hand-off) by request id (none may fail)."""
    results = {}
    for _ in range(max_steps):
        for result in outcomes(engine.step()):
            if is_first_token(result):   # sent ahead of its hand-off; the done output follows
                continue
            assert is_result(result), result
            results[result.request_id] = result
        if not engine.has_work:
            return results
    raise AssertionError("prefill did not finish")


def outcomes(step: EngineStep) -> list:
    """A prefill step's outcomes, one list: its TokenOuts, then its RequestFailures."""
    return [*step.tokens, *step.failed]


def is_first_token(outcome) -> bool:
    """A first token prefill reported ahead of its hand-off (its done output follows)."""
    return isinstance(outcome, TokenOut) and not outcome.done


def is_result(outcome) -> bool:
    """A request prefill is done with: its first token and its hand-off."""
    return isinstance(outcome, TokenOut) and outcome.done


def run_decode(engine: DecodeEngine, prompts: list[list[int]], prefilled: dict, max_steps: int = 2000) -> dict:
    outputs = {}
    for i, ids in enumerate(prompts):
        result = prefilled[f"r{i}"]
        outputs[f"r{i}"] = [result.token]
        engine.add(DecodeTask(f"r{i}", ids, result.token, GREEDY, time.time() + 60, "",
                              result.outputs.kv_key, result.outputs.kv_handle))
    for _ in range(max_steps):
        out = engine.step()
        assert not out.failed, out.failed
        for token in out.tokens:
            outputs[token.request_id].append(token.token)
        if not engine.has_work:
            return outputs
    raise AssertionError("decode did not finish")


def decode_engine(model, connector, num_blocks: int, block_size: int = 16, max_num_seqs: int = 16) -> DecodeEngine:
    cfg = model.config
    cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=block_size, num_blocks=num_blocks,
                         dtype=model.dtype)
    return DecodeEngine(LocalRunner(model, cache), connector, max_num_seqs=max_num_seqs, max_model_len=2048,
                        transfer_timeout_s=5)


