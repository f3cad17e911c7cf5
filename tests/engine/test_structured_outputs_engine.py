"""Structured outputs in the engines, in one process: xgrammar's bitmask applied by prefill (first
token) and decode (the rest), the matcher rebuilt by replay on a hand-off and on a resumed stream,
one compile per schema, and a bad spec failing its request alone.

The real shared-memory connector carries the KV between the engines, as between worker processes.
"""

from __future__ import annotations

import json
import time

import jsonschema
import msgspec
import pytest

from omnirelay.request_params import StructuredOutput
from omnirelay.workers.llm.decode import DecodeTask
from omnirelay.workers.llm.prefill import PrefillEngine, PrefillTask
from omnirelay.request_params import TextParams
from omnirelay.workers.llm.structured_output import GrammarCompilerCache, GrammarSampler

from engine_support import (  # noqa: F401
    chat_ids, connector, decode_engine, is_first_token, is_result, model, outcomes, runner_for, tok)

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                         "sunny": {"type": "boolean"},
                         "rating": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["city", "sunny", "rating"], "additionalProperties": False}
JSON_SPEC = StructuredOutput("json_schema", json.dumps(SCHEMA))
GREEDY = TextParams(max_tokens=64, temperature=0)


def grammar_sampler(tiny_model, model) -> GrammarSampler:
    return GrammarSampler(GrammarCompilerCache(tiny_model, model.config.vocab_size, model.config.eos_token_ids))


def engines(tiny_model, model, connector):
    prefill = PrefillEngine(runner_for(model, block_size=4, kv_cache_bytes=4 << 20), connector, max_model_len=2048,
                            prefix_caching=False, grammars=grammar_sampler(tiny_model, model))
    decode = decode_engine(model, connector, num_blocks=256)
    decode.grammars = grammar_sampler(tiny_model, model)
    return prefill, decode


def generate(prefill, decode, prompts: dict[str, list[int]], spec: dict[str, StructuredOutput | None],
             params: TextParams = GREEDY, offsets: dict[str, int] | None = None) -> dict[str, tuple[list[int], str]]:
    """Prefill then decode every prompt; → request id: (output tokens, finish reason)."""
    offsets = offsets or {}
    for rid, ids in prompts.items():
        prefill.add(PrefillTask(rid, ids, msgspec.structs.replace(params, structured=spec[rid]), time.time() + 60,
                                position_offset=offsets.get(rid, 0)))
    out: dict[str, tuple[list[int], str]] = {}
    for _ in range(50):
        for result in outcomes(prefill.step()):
            if is_first_token(result):   # sent ahead of its hand-off; the done output follows
                continue
            assert is_result(result), result
            if result.finish_reason:
                out[result.request_id] = ([result.token], result.finish_reason)
                continue
            decode.add(DecodeTask(result.request_id, prompts[result.request_id], result.token,
                                  msgspec.structs.replace(params, structured=spec[result.request_id]),
                                  time.time() + 60, "", result.outputs.kv_key, result.outputs.kv_handle,
                                  position_offset=offsets.get(result.request_id, 0)))
            out[result.request_id] = ([result.token], "")
        if not prefill.has_work:
            break
    for _ in range(500):
        step = decode.step()
        assert not step.failed, step.failed
        for token in step.tokens:
            out[token.request_id][0].append(token.token)
            if token.finish_reason:
                out[token.request_id] = (out[token.request_id][0], token.finish_reason)
        if not decode.has_work:
            return out
    raise AssertionError("decode did not finish")


def test_json_schema_output_validates_and_leaves_free_rows_alone(tiny_model, model, tok, connector):
    prefill, decode = engines(tiny_model, model, connector)
    prompt = chat_ids(tok, "Describe the weather in a city as JSON.")
    free = generate(prefill, decode, {"free": prompt}, {"free": None})["free"]
    both = generate(prefill, decode, {"json": prompt, "free": prompt}, {"json": JSON_SPEC, "free": None})
    tokens, reason = both["json"]
    assert reason == "stop" and tokens[-1] in model.config.eos_token_ids   # EOS only once the JSON is whole
    answer = json.loads(tok.decode(tokens, skip_special_tokens=True))
    jsonschema.validate(answer, SCHEMA)
    assert both["free"] == free                       # the mask touched only its own row
    assert tok.decode(free[0], skip_special_tokens=True) != tok.decode(tokens, skip_special_tokens=True)
    # Compiled once per engine process for all of its requests; every matcher released.
    assert prefill.grammars.stats["grammar_compiles"] == 1 and decode.grammars.stats["grammar_compiles"] == 1
    assert "json" not in prefill.grammars and "json" not in decode.grammars
    # The decode matcher was built by replaying prefill's first token.
    assert decode.grammars.stats["grammar_replayed_tokens"] == 1


def test_compile_cache_is_per_spec(tiny_model, model, tok, connector):
    prefill, decode = engines(tiny_model, model, connector)
    prompts = {f"r{i}": chat_ids(tok, q) for i, q in enumerate(["Hi!", "Why?", "Count to three."])}
    out = generate(prefill, decode, prompts, dict.fromkeys(prompts, JSON_SPEC))
    for tokens, reason in out.values():
        jsonschema.validate(json.loads(tok.decode(tokens, skip_special_tokens=True)), SCHEMA)
    assert decode.grammars.stats["grammar_compiles"] == 1 and decode.grammars.stats["grammar_cache_hits"] >= 2


@pytest.mark.parametrize("spec, check", [
    (StructuredOutput("regex", r"(yes|no), [a-z]{2,6}\."), r"(yes|no), [a-z]{2,6}\."),
    (StructuredOutput("grammar", 'root ::= "red" | "green" | "blue"'), r"red|green|blue"),
])
def test_regex_and_grammar(tiny_model, model, tok, connector, spec, check):
    import re

    prefill, decode = engines(tiny_model, model, connector)
    tokens, reason = generate(prefill, decode, {"r": chat_ids(tok, "Answer.")}, {"r": spec})["r"]
    assert reason == "stop"
    assert re.fullmatch(check, tok.decode(tokens, skip_special_tokens=True))


def test_resumed_stream_replays_its_tokens_into_the_grammar(tiny_model, model, tok, connector):
    """A stream cut after k tokens and resumed with prompt + those tokens (position_offset k), as
    the gateway does when a decode worker dies, continues under the same grammar state: the result
    equals the uninterrupted run and still validates. Sampled (seeded), so the grammar matters."""
    params = TextParams(max_tokens=64, temperature=0.8, seed=7)
    prompt = chat_ids(tok, "Weather report as JSON, please.")
    prefill, decode = engines(tiny_model, model, connector)
    whole, reason = generate(prefill, decode, {"r": prompt}, {"r": JSON_SPEC}, params)["r"]
    assert reason == "stop" and len(whole) > 8
    k = 6
    rest_params = TextParams(max_tokens=64 - k, temperature=0.8, seed=7)
    prefill2, decode2 = engines(tiny_model, model, connector)
    rest, reason2 = generate(prefill2, decode2, {"r": prompt + whole[:k]}, {"r": JSON_SPEC}, rest_params,
                             offsets={"r": k})["r"]
    assert whole[:k] + rest == whole and reason2 == "stop"
    assert prefill2.grammars.stats["grammar_replayed_tokens"] == k        # prefill replayed the k tokens
    assert decode2.grammars.stats["grammar_replayed_tokens"] == k + 1     # decode: those and prefill's
    jsonschema.validate(json.loads(tok.decode(whole, skip_special_tokens=True)), SCHEMA)


def test_a_spec_xgrammar_refuses_fails_only_its_request(tiny_model, model, tok, connector):
    prefill, _ = engines(tiny_model, model, connector)
    prompt = chat_ids(tok, "Hi!")
    prefill.add(PrefillTask("bad", prompt, msgspec.structs.replace(GREEDY, structured=StructuredOutput("regex", "(ab")),
                            time.time() + 60))
    prefill.add(PrefillTask("good", prompt, GREEDY, time.time() + 60))
    results = {r.request_id: r for _ in range(5) for r in outcomes(prefill.step()) if not is_first_token(r)}
    assert results["bad"].error_type == "bad_request" and "regex" in results["bad"].message
    assert is_result(results["good"])
    # An engine without grammar support refuses such a request instead of ignoring its grammar.
    plain = PrefillEngine(runner_for(model, block_size=4, kv_cache_bytes=4 << 20), connector, max_model_len=2048)
    plain.add(PrefillTask("r", prompt, msgspec.structs.replace(GREEDY, structured=JSON_SPEC), time.time() + 60))
    [result] = outcomes(plain.step())
    assert result.error_type == "bad_request" and "structured output" in result.message
