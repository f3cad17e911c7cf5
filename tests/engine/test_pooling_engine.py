"""Pooling in the prefill engine, in one process: the vectors of last-token, mean and CLS pooling equal
sentence-transformers' on the tiny Qwen3-Embedding-style model (cosine >= 0.9999), across chunked
prefill (a prompt longer than a step's token budget), a prefix-cache hit (last token) and a batch
mixed with a chat prompt that still hands its KV on; Matryoshka truncation renormalises."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from omnirelay.connectors import create_connector
from omnirelay.deploy.builders.qwen3_embedding import cached_qwen3_embedding
from omnirelay.pooling_params import PoolingParams
from omnirelay.request_params import POOLING_PREFILL, TextParams
from omnirelay.workers.llm.models.llama import LlamaModel
from omnirelay.workers.llm.prefill import PrefillEngine, PrefillTask

from engine_support import drain_prefill, runner_for

pytestmark = pytest.mark.timeout(300)

TEXTS = ["Hello there.", "The harbor town woke slowly, and the market opened at dawn.",
         "A good recipe is a small program: " + "stir gently and season with a little pepper, " * 6]


@pytest.fixture
def connector(tmp_path):
    conn = create_connector("shared_memory", {"shm_dir": str(tmp_path)})
    yield conn
    conn.close()


def _reference(path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_numpy=True)


def _pool(engine: PrefillEngine, prompts: list[list[int]], params: PoolingParams, chat: list[int] | None = None):
    for i, ids in enumerate(prompts):
        engine.add(PrefillTask(f"e{i}", ids, POOLING_PREFILL, time.time() + 60, pooling=params))
    if chat is not None:
        engine.add(PrefillTask("chat", chat, TextParams(max_tokens=4, temperature=0), time.time() + 60))
    results = drain_prefill(engine)
    if chat is not None:
        assert results.pop("chat").outputs is not None   # its KV still goes on to decode
    return [np.frombuffer(results[f"e{i}"].pooled, dtype="<f4") for i in range(len(prompts))]


def _cosines(a: np.ndarray, b: np.ndarray) -> list[float]:
    return [float(x @ y / np.linalg.norm(x) / np.linalg.norm(y)) for x, y in zip(a, b)]


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_vectors_equal_sentence_transformers(pooling, connector, tmp_path):
    torch.set_num_threads(1)
    path = cached_qwen3_embedding(pooling)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    assert max(map(len, prompts)) > 32   # the last one runs over several steps
    model = LlamaModel(path)
    engine = PrefillEngine(runner_for(model, block_size=4, kv_cache_bytes=4 << 20), connector, max_model_len=2048,
                           max_batched_tokens=32)
    try:
        ours = _pool(engine, prompts, PoolingParams(pooling=pooling), chat=prompts[1][:-1])
        reference = _reference(path, TEXTS)
        assert min(_cosines(np.stack(ours), reference)) >= 0.9999
        assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in ours)
        if pooling == "last":   # again, now from the prefix cache: the last token still pools the same
            again = _pool(engine, prompts, PoolingParams(pooling=pooling))
            assert engine.stats["prefix_cached_tokens"] > 0
            assert min(_cosines(np.stack(again), reference)) >= 0.9999
        raw = _pool(engine, prompts[:1], PoolingParams(pooling=pooling, normalize=False))[0]
        short = _pool(engine, prompts[:1], PoolingParams(pooling=pooling, dimensions=64))[0]
        assert short.shape == (64,) and abs(np.linalg.norm(short) - 1) < 1e-5
        assert _cosines(short[None], raw[None, :64])[0] >= 0.9999   # truncated, then renormalised
        assert abs(np.linalg.norm(raw) - 1) > 1e-3                  # normalize false: the raw pooled state
    finally:
        engine.close()
