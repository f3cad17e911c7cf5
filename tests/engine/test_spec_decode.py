"""Speculative decoding (ngram) in the decode engine against the same engine without it.

The real prefill and decode engines in one process, the real shared-memory connector between them,
the tiny random model: its greedy answers repeat themselves, so prompt lookup drafts and the target
accepts (the tests check that it did, by the engine's counters, before comparing). Every option a
decode step honours is run both ways and must give the same tokens; the random sampler's
acceptance rule is checked statistically with fixed seeds.
"""

from __future__ import annotations

import collections
import json
import time

import msgspec
import pytest
import torch

from omnirelay.request_params import StructuredOutput, TextParams
from omnirelay.speculative import SpeculativeConfig
from omnirelay.workers.kv.cache import PagedKVCache
from omnirelay.workers.llm.decode import DecodeEngine, DecodeTask
from omnirelay.workers.llm.logits_processors import LogitsProcessors
from omnirelay.workers.llm.model_runner import LocalRunner
from omnirelay.workers.llm.prefill import PrefillEngine, PrefillTask
from omnirelay.workers.llm.requests import Request
from omnirelay.workers.llm.spec_decode import NgramProposer, SpeculativeDecoder
from omnirelay.workers.llm.structured_output import GrammarCompilerCache, GrammarSampler

from engine_support import (  # noqa: F401  (fixtures)
    QUESTIONS, chat_ids, connector, drain_prefill, model, runner_for, tok)

NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=5, prompt_lookup_max=4, prompt_lookup_min=1)
# Answers that quote their prompt: prompt lookup drafts from the prompt itself.
COPY_PROMPTS = ["Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps.",
                "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n# copy the function above"]


def _params(**overrides) -> TextParams:
    return TextParams(**{"max_tokens": 40, "temperature": 0, "ignore_eos": True, **overrides})


def _decode(model, connector, *, speculative=None, num_blocks=256, grammars=None, lora=None,
            max_num_seqs=16) -> DecodeEngine:
    cfg = model.config
    cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=16, num_blocks=num_blocks,
                         dtype=model.dtype)
    return DecodeEngine(LocalRunner(model, cache), connector, max_num_seqs=max_num_seqs, max_model_len=2048,
                        transfer_timeout_s=5, grammars=grammars, lora=lora, speculative=speculative)


def generate(model, connector, jobs: list[tuple[list[int], TextParams]], decode: DecodeEngine,
             prefill: PrefillEngine | None = None) -> list[dict]:
    """Prefill then decode every ``(prompt ids, params)`` at once; per job its tokens, logprobs
    and finish reason."""
    prefill = prefill or PrefillEngine(runner_for(model, block_size=16, kv_cache_bytes=8 << 20), connector,
                                       max_model_len=2048, prefix_caching=False, grammars=decode.grammars,
                                       lora=decode.lora)
    for i, (ids, params) in enumerate(jobs):
        prefill.add(PrefillTask(f"r{i}", ids, params, time.time() + 120))
    prefilled = drain_prefill(prefill, max_steps=400)
    results = [{"tokens": [], "logprobs": [], "reason": ""} for _ in jobs]
    for i, (ids, params) in enumerate(jobs):
        first = prefilled[f"r{i}"]
        results[i]["tokens"].append(first.token)
        if first.finish_reason:
            results[i]["reason"] = first.finish_reason
            continue
        decode.add(DecodeTask(f"r{i}", ids, first.token, params, time.time() + 120, "", first.outputs.kv_key,
                              first.outputs.kv_handle))
    for _ in range(4000):
        step = decode.step()
        assert not step.failed, step.failed
        for token in step.tokens:
            result = results[int(token.request_id[1:])]
            result["tokens"].append(token.token)
            result["logprobs"].append(token.logprobs)
            result["reason"] = token.finish_reason or result["reason"]
        if not decode.has_work:
            return results
    raise AssertionError("decode did not finish")


def both_ways(model, connector, jobs, **engine_args) -> tuple[list[dict], list[dict], DecodeEngine]:
    plain = generate(model, connector, jobs, _decode(model, connector, **engine_args))
    spec_engine = _decode(model, connector, speculative=NGRAM, **engine_args)
    spec = generate(model, connector, jobs, spec_engine)
    assert spec_engine.allocator.free == spec_engine.runner.num_blocks - 1   # every block came back
    return plain, spec, spec_engine


def _prompts(tok) -> list[list[int]]:
    return [chat_ids(tok, q) for q in [*QUESTIONS[:4], *COPY_PROMPTS]]


def _accepted(engine: DecodeEngine) -> int:
    assert engine.stats["spec_decode_num_drafts"] > 0
    return engine.stats["spec_decode_num_accepted_tokens"]


def test_proposer_finds_the_longest_recurring_suffix_and_copies_on():
    proposer = NgramProposer(NGRAM)
    assert proposer.propose([1, 2, 3, 4, 5, 9, 1, 2, 3], 10) == [4, 5, 9, 1, 2]
    assert proposer.propose([7, 1, 2, 3, 1, 2, 3], 3) == [1, 2, 3]
    assert proposer.propose([8, 8], 10) == [8, 8, 8, 8, 8]     # a span that repeats is copied k ahead
    assert proposer.propose([1, 2, 3], 10) == []                # nothing recurs
    assert proposer.propose([1, 2, 1, 2], 0) == []              # no room left to emit


def test_greedy_output_is_identical_with_ngram_and_fewer_steps(model, tok, connector):
    jobs = [(ids, _params()) for ids in _prompts(tok)]
    plain, spec, engine = both_ways(model, connector, jobs)
    assert [r["tokens"] for r in spec] == [r["tokens"] for r in plain]
    assert all(r["reason"] == "length" for r in spec)
    accepted = _accepted(engine)
    assert accepted > 0
    # Each accepted draft is a token emitted without a forward of its own.
    assert engine.stats["decode_tokens"] == sum(len(r["tokens"]) - 1 for r in spec)
    assert engine.stats["decode_steps"] <= max(len(r["tokens"]) for r in spec) * len(spec) - accepted
    per_position = [engine.stats[f"spec_decode_num_accepted_tokens_per_pos_{i}"] for i in range(5)]
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)


@pytest.mark.parametrize("options", [
    {"logprobs": 3},
    {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.4},
    {"logit_bias": ((11, 3.0), (220, -2.0)), "min_tokens": 8, "bad_words_token_ids": ((13, 14),)},
    {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "seed": 7},
    {"temperature": 1.0, "min_p": 0.05, "seed": 123, "logprobs": 0},
], ids=["logprobs", "penalties", "bias-min-tokens-bad-words", "seeded-sampling", "seeded-min-p-logprobs"])
def test_each_option_gives_the_same_tokens(model, tok, connector, options):
    jobs = [(ids, _params(**options)) for ids in _prompts(tok)]
    plain, spec, engine = both_ways(model, connector, jobs)
    assert [r["tokens"] for r in spec] == [r["tokens"] for r in plain]
    _accepted(engine)
    if options.get("logprobs", -1) >= 0:
        for a, b in zip(plain, spec):
            for x, y in zip(a["logprobs"], b["logprobs"]):
                assert abs(x.logprob - y.logprob) < 1e-4
                assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_stop_tokens_and_eos_end_where_they_would(model, tok, connector):
    ids = _prompts(tok)
    plain_run = generate(model, connector, [(p, _params()) for p in ids], _decode(model, connector))
    # Stop on a token each answer emits midway: the answer ends there, drafts beyond it dropped.
    jobs = [(p, _params(stop_token_ids=(r["tokens"][len(r["tokens"]) // 2],), ignore_eos=False))
            for p, r in zip(ids, plain_run)]
    plain, spec, engine = both_ways(model, connector, jobs)
    assert [r["tokens"] for r in spec] == [r["tokens"] for r in plain]
    assert [r["reason"] for r in spec] == [r["reason"] for r in plain]
    assert all(r["reason"] == "stop" for r in spec)


def test_structured_output_under_speculation(tiny_model, model, tok, connector):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                               "rating": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["city", "rating"], "additionalProperties": False}
    spec_json = StructuredOutput("json_schema", json.dumps(schema))

    def grammars():
        return GrammarSampler(GrammarCompilerCache(tiny_model, model.config.vocab_size, model.config.eos_token_ids))

    jobs = [(ids, _params(max_tokens=64, ignore_eos=False, structured=spec_json if i % 2 else None))
            for i, ids in enumerate(_prompts(tok))]
    plain = generate(model, connector, jobs, _decode(model, connector, grammars=grammars()))
    engine = _decode(model, connector, grammars=grammars(), speculative=NGRAM)
    spec = generate(model, connector, jobs, engine)
    assert [r["tokens"] for r in spec] == [r["tokens"] for r in plain]
    for i, result in enumerate(spec):
        if i % 2:
            assert result["reason"] == "stop"
            json.loads(tok.decode(result["tokens"], skip_special_tokens=True))
    _accepted(engine)


def test_lora_rows_verify_under_their_adapter(tiny_model, tok, connector, tmp_path):
    pytest.importorskip("peft")
    from omnirelay.deploy.builders.lora import build_tiny_lora
    from omnirelay.workers.llm.lora import LoraSlots
    from omnirelay.workers.llm.models.llama import LlamaModel
    adapter = str(build_tiny_lora(tiny_model, tmp_path / "a1", rank=8, seed=1))

    def engines(speculative):
        pm, dm = LlamaModel(tiny_model), LlamaModel(tiny_model)
        prefill = PrefillEngine(runner_for(pm, block_size=16, kv_cache_bytes=8 << 20), connector, max_model_len=2048,
                                lora=LoraSlots(pm, {"a1": adapter}, max_loras=1, max_rank=16))
        return prefill, _decode(dm, connector, speculative=speculative,
                                lora=LoraSlots(dm, {"a1": adapter}, max_loras=1, max_rank=16))

    jobs = [(ids, _params(lora="a1" if i % 2 else "")) for i, ids in enumerate(_prompts(tok))]
    prefill, decode = engines(None)
    plain = generate(None, connector, jobs, decode, prefill)
    prefill, decode = engines(NGRAM)
    spec = generate(None, connector, jobs, decode, prefill)
    assert [r["tokens"] for r in spec] == [r["tokens"] for r in plain]
    _accepted(decode)


def test_preemption_and_block_rollback_under_speculation(model, tok, connector):
    # 14 blocks of 16 tokens for 6 sequences of ~60-100 tokens: preemptions happen, drafts get only free blocks.
    jobs = [(ids, _params(max_tokens=48)) for ids in _prompts(tok)]
    plain, spec, engine = both_ways(model, connector, jobs, num_blocks=15)
    assert [r["tokens"] for r in spec] == [r["tokens"] for r in plain]
    assert engine.stats["preemptions"] > 0
    _accepted(engine)


def test_a_thousand_requests_leave_the_pool_free(model, tok, connector):
    """Rollback leaks nothing: 1,000 requests (rejections, acceptances, finishes mid-draft) and
    every block is back."""
    prompts = _prompts(tok)
    decode = _decode(model, connector, speculative=NGRAM, num_blocks=64, max_num_seqs=32)
    prefill = PrefillEngine(runner_for(model, block_size=16, kv_cache_bytes=16 << 20), connector,
                            max_model_len=2048, max_batched_tokens=4096, max_batch=64)
    done = 0
    for wave in range(1000 // 50):
        jobs = [(prompts[(wave + i) % len(prompts)], _params(max_tokens=3 + (i % 9), seed=i,
                                                             temperature=0 if i % 3 else 1.0))
                for i in range(50)]
        results = generate(model, connector, jobs, decode, prefill)
        done += sum(1 for r in results if r["reason"])
        assert decode.allocator.free == decode.runner.num_blocks - 1
        assert not decode.running and decode.num_requests == 0
    assert done == 1000
    assert decode.stats["spec_decode_num_accepted_tokens"] > 0
    assert decode.stats["spec_decode_num_draft_tokens"] > decode.stats["spec_decode_num_accepted_tokens"]


class _Task:
    """A decode task's fields the acceptance rule reads (the rest of DecodeTask does not matter here)."""

    def __init__(self, request_id: str, params: TextParams):
        self.request_id, self.params = request_id, params
        self.prompt_token_ids, self.position_offset, self.speech_inputs = [0, 1, 2], 0, None


def test_sampled_acceptance_follows_the_target_distribution():
    """A point-mass draft x is kept with probability p(x), and a rejected position's token follows p
    with x removed and renormalised: 6,000 seeded rows against a fixed target distribution."""
    probs = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    logits = torch.log(probs)[None].repeat(2, 1)   # row 0: the drafted position; row 1: the bonus
    stats = collections.Counter()
    decoder = SpeculativeDecoder(NGRAM, stats=stats, processors=LogitsProcessors((99,)), grammars=None,
                                 eos_token_ids=(99,), max_model_len=100)
    draft, trials = 2, 6000
    first = collections.Counter()
    for seed in range(trials):
        seq = Request(_Task(f"s{seed}", TextParams(max_tokens=10, temperature=1.0, seed=seed)), generated=[0])
        result = decoder.accept(logits, [seq], [[draft]], lambda s: None)[0]
        first[result.tokens[0]] += 1
        assert (result.accepted == 1) == (result.tokens[0] == draft) and len(result.tokens) == 1 + result.accepted
        # Reproducible: the same seed gives the same tokens.
        again = Request(_Task(f"s{seed}", TextParams(max_tokens=10, temperature=1.0, seed=seed)), generated=[0])
        assert decoder.accept(logits, [again], [[draft]], lambda s: None)[0].tokens == result.tokens
    rate = stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"]
    sigma = (probs[draft] * (1 - probs[draft]) / trials).sqrt()
    assert abs(rate - probs[draft]) < 5 * sigma, rate
    rejected = trials - first[draft]
    residual = probs.clone()
    residual[draft] = 0
    residual /= residual.sum()
    for token in (0, 1, 3, 4):   # each residual frequency within 5 sigma of its renormalised probability
        p = float(residual[token])
        assert abs(first[token] / rejected - p) < 5 * (p * (1 - p) / rejected) ** 0.5, (token, first[token])


def test_a_resumed_stream_speculates_from_its_resumed_tokens(model, tok, connector):
    """A resumed stream (tokens the client has at the end of the prompt) speculates from them and
    gives the same continuation as without speculation."""
    ids = _prompts(tok)[4]
    run = generate(model, connector, [(ids, _params())], _decode(model, connector))[0]["tokens"]
    resumed = ids + run[:10]

    def resume(speculative):
        decode = _decode(model, connector, speculative=speculative)
        prefill = PrefillEngine(runner_for(model, block_size=16, kv_cache_bytes=8 << 20), connector,
                                max_model_len=2048, prefix_caching=False)
        params = _params(max_tokens=30)
        prefill.add(PrefillTask("r0", resumed, params, time.time() + 60, position_offset=10))
        first = drain_prefill(prefill)["r0"]
        decode.add(DecodeTask("r0", resumed, first.token, params, time.time() + 60, "", first.outputs.kv_key,
                              first.outputs.kv_handle, position_offset=10))
        tokens = [first.token]
        while decode.has_work:
            tokens += [t.token for t in decode.step().tokens]
        return tokens, decode

    plain, _ = resume(None)
    spec, engine = resume(NGRAM)
    assert spec == plain == run[10:40]
    _accepted(engine)
