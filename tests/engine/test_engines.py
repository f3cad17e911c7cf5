"""The prefill and decode engines in one process, against transformers on the same directory.

No network: the real shared-memory connector (in a private directory) carries the KV between the
two engines, as it does between worker processes. Counting, not timing, shows batching, chunking,
prefix caching and preemption happened.
"""

from __future__ import annotations

import pytest
import torch

from omnirelay.workers.llm.models.llama import LlamaModel
from omnirelay.workers.kv.export import import_kv
from omnirelay.workers.llm.prefill import PrefillEngine
from omnirelay.block_hash import block_hashes
from omnirelay.workers.kv.prefix_cache import PrefixCachingAllocator

from engine_support import (  # noqa: F401  (fixtures)
    QUESTIONS, SYSTEM, chat_ids, connector, decode_engine, model, reference, run_decode, run_prefill, runner_for, tok)


def test_batched_chunked_prefill_and_decode_equal_transformers(model, tok, reference, connector):
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    # A 24-token budget splits most prompts into chunks and packs tails of one with heads of another.
    prefill = PrefillEngine(runner_for(model, block_size=4, kv_cache_bytes=4 << 20), connector, max_model_len=2048,
                            max_batched_tokens=24, prefix_caching=False)
    prefilled = run_prefill(prefill, prompts)
    assert prefill.stats["prefill_tokens"] == sum(map(len, prompts))
    assert prefill.stats["prefill_steps"] == -(-sum(map(len, prompts)) // 24)
    assert prefill.allocator.free == prefill.runner.num_blocks - 1      # every block came back
    # Each KV was gathered straight into a shared memory segment: no put copied it.
    health = connector.health()
    assert health["puts_in_place"] == health["puts"] == len(prompts)
    outputs = run_decode(decode_engine(model, connector, num_blocks=256), prompts, prefilled)
    for i, ids in enumerate(prompts):
        assert outputs[f"r{i}"] == reference(ids), QUESTIONS[i]


def test_one_big_batch_equals_one_at_a_time(model, tok, connector):
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    together = PrefillEngine(runner_for(model), connector, max_model_len=2048, max_batched_tokens=4096)
    alone = PrefillEngine(runner_for(model), connector, max_model_len=2048, max_batch=1)
    # Both runs use the same request ids, so each run's KV is imported (and its keys consumed) first.
    a = run_prefill(together, prompts)
    kv_a = {k: import_kv(connector, r.outputs.kv_key, r.outputs.kv_handle, timeout=5) for k, r in a.items()}
    b = run_prefill(alone, prompts)
    kv_b = {k: import_kv(connector, r.outputs.kv_key, r.outputs.kv_handle, timeout=5) for k, r in b.items()}
    assert together.stats["prefill_steps"] == 1 and alone.stats["prefill_steps"] == len(prompts)
    for key in a:
        assert a[key].token == b[key].token
        assert torch.allclose(kv_a[key], kv_b[key], atol=1e-5)


def test_prefix_cache_skips_the_shared_system_prompt(model, tok, reference, connector):
    prompts = [chat_ids(tok, q, SYSTEM) for q in QUESTIONS[:3]]
    common = 0
    while all(p[common] == prompts[0][common] for p in prompts):
        common += 1
    assert common >= 40
    bs = 8
    engine = PrefillEngine(runner_for(model, block_size=bs, kv_cache_bytes=4 << 20), connector, max_model_len=2048)
    first = run_prefill(engine, prompts[:1])
    assert engine.stats["prefix_cached_tokens"] == 0
    assert engine.prefix_hit_tokens(prompts[1]) == common // bs * bs
    added, removed = engine.prefix_events()
    assert added == block_hashes(prompts[0], bs)[: len(added)] and len(added) == len(prompts[0]) // bs
    assert removed == []

    rest = run_prefill(engine, prompts[1:], first=1)
    cached = 2 * (common // bs * bs)
    assert engine.stats["prefix_cached_tokens"] == cached
    assert engine.stats["prefill_tokens"] == sum(map(len, prompts)) - cached
    assert engine.stats["prefix_hit_requests"] == 2
    # Outputs built on reused blocks are the same tokens.
    outputs = run_decode(decode_engine(model, connector, num_blocks=128), prompts, {**first, **rest})
    for i, ids in enumerate(prompts):
        assert outputs[f"r{i}"] == reference(ids)


def test_identical_prompt_still_computes_its_last_token(model, tok, connector):
    ids = chat_ids(tok, QUESTIONS[1], SYSTEM)
    ids = ids[: len(ids) // 8 * 8]      # a whole number of blocks: everything could match
    engine = PrefillEngine(runner_for(model, block_size=8, kv_cache_bytes=4 << 20), connector, max_model_len=2048)
    a = run_prefill(engine, [ids])["r0"]
    b = run_prefill(engine, [ids], first=1)["r1"]
    assert a.token == b.token
    assert engine.stats["prefill_tokens"] == len(ids) + 8   # the second run recomputed one block


def test_prefix_allocator_evicts_least_recently_used_and_shares():
    alloc = PrefixCachingAllocator(6)            # 5 usable blocks
    a = alloc.allocate(3)
    for block, name in zip(a, [b"a0", b"a1", b"a2"]):
        alloc.register(block, name)
    alloc.release(a)
    assert alloc.free == 5 and alloc.num_cached == 3
    hits = alloc.match([b"a0", b"a1", b"zz"])
    assert hits == a[:2]
    alloc.acquire(hits)
    assert alloc.free == 3
    fresh = alloc.allocate(3)                    # 2 never-named + evicts a2 (the tail, released first)
    assert a[2] in fresh and alloc.match([b"a0", b"a1", b"a2"]) == a[:2]
    assert alloc.drain_events() == ([b"a0", b"a1"], [b"a2"])
    alloc.release(hits + fresh)
    assert alloc.free == 5


def test_preemption_when_blocks_run_out(model, tok, reference, connector):
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    prefilled = run_prefill(PrefillEngine(runner_for(model), connector, max_model_len=2048), prompts)
    # 8-token blocks; the longest sequence needs 7 of the 14 usable blocks; all six need ~30.
    engine = decode_engine(model, connector, num_blocks=15, block_size=8)
    outputs = run_decode(engine, prompts, prefilled)
    assert engine.stats["preemptions"] > 0 and engine.stats["recomputed_tokens"] > 0
    for i, ids in enumerate(prompts):
        assert outputs[f"r{i}"] == reference(ids), QUESTIONS[i]
    assert engine.allocator.free == 14


def test_native_decode_attention_matches_torch(tiny_model, model, tok, connector):
    from omnirelay.workers.llm import native_attention
    if native_attention.load() is None:
        pytest.skip("no C compiler here: the torch path is the only one")
    assert model._native is not None
    # Built with -ffast-math but linked without it: the process must not have switched to flush-to-zero.
    assert float(torch.tensor([1e-39]) * 1.0) != 0.0
    plain = LlamaModel(tiny_model, attention="torch")
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    # Whole-KV handoff: the test reads each KV twice (once per engine) without consuming it.
    engine = PrefillEngine(runner_for(model), connector, max_model_len=2048, kv_transfer="whole")
    prefilled = run_prefill(engine, prompts)
    engines = [decode_engine(m, connector, num_blocks=128) for m in (model, plain)]
    # Same KV into both pools, then the same steps: logits agree to float32 rounding.
    outs = []
    for engine in engines:
        for i, ids in enumerate(prompts):
            kv = connector.get(prefilled[f"r{i}"].outputs.kv_key)["kv"]
            blocks = engine.allocator.allocate(engine.blocks_needed(len(ids) + 1))
            engine.runner.write_kv(blocks, kv)
            outs.append((engine, blocks))
    from omnirelay.workers.llm.forward_batch import ForwardBatch
    width = max(len(b) for _, b in outs)
    logits = []
    for engine in engines:
        rows = [b + [0] * (width - len(b)) for e, b in outs if e is engine]
        batch = ForwardBatch.decode(torch.tensor([prefilled[f"r{i}"].token for i in range(len(prompts))]),
                                    torch.tensor([len(p) for p in prompts]), torch.tensor(rows), 16)
        logits.append(engine.runner.forward(batch))
    assert torch.allclose(logits[0], logits[1], atol=1e-3, rtol=1e-5)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
