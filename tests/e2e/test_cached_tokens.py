"""``usage.prompt_tokens_details.cached_tokens``: the prompt tokens prefill took from its prefix cache,
carried on the first token's ``TokenDelta.cached_tokens`` to the gateway and reported in chat,
completions and Responses usage (``input_tokens_details``), through the official ``openai`` client
against the session's ``omni-serve`` (one prefill worker, prefix caching on)."""

from __future__ import annotations

import uuid

import pytest

from omnirelay.broker import protocol as p

MODEL = "tiny-llm"


def _long_prompt() -> str:
    """About 200 tokens, new to the cache (a fresh id first, so no earlier test shares a block)."""
    return f"{uuid.uuid4().hex} " + " ".join(f"item {i} is the colour of the sea at dawn;" for i in range(20))


def test_delta_field_is_off_the_wire_when_zero():
    plain = p.TokenDelta("r", 0, [5], "", "w")
    assert p.encode(plain) == p.encode(p.TokenDelta("r", 0, [5], "", "w", cached_tokens=0))
    assert p.decode(p.encode(p.TokenDelta("r", 0, [5], cached_tokens=48))).cached_tokens == 48
    with pytest.raises(ValueError):
        p.TokenDelta("r", 0, [5], cached_tokens=-1)


def test_chat_second_time_reports_cached_prefix(client):
    messages = [{"role": "user", "content": _long_prompt()}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens == first.usage.prompt_tokens
    # Streamed with usage: the same count, on the usage chunk.
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_completions_and_responses_report_it(client):
    prompt = _long_prompt()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    # n choices of one prompt: what was cached before the request (the siblings' reuse is not counted)
    fresh = client.completions.create(model=MODEL, prompt=_long_prompt(), max_tokens=2, temperature=0, n=3)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, n=2)
    assert again.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens_details.cached_tokens

    text = _long_prompt()
    one = client.responses.create(model=MODEL, input=text, max_output_tokens=2, temperature=0)
    two = client.responses.create(model=MODEL, input=text, max_output_tokens=2, temperature=0)
    assert one.usage.input_tokens_details.cached_tokens == 0
    assert 0 < two.usage.input_tokens_details.cached_tokens < two.usage.input_tokens
