"""What chat and completion answers report in ``usage`` (gateway/usage.py), as vLLM 0.32 does, without a
cluster: the renderers of routes/completions.py and routes/choices.py over a real aiohttp server, fed
scripted token chunks. ``stream_options`` under ``--enable-force-include-usage`` (usage on every
stream, on each chunk and in a last one), ``continuous_usage_stats`` (each chunk its own choice's
tokens so far: 0 on chat's role chunk, never the sum of every choice), no ``usage`` key on a chunk
that reports none, and ``prompt_tokens_details.cached_tokens`` only with
``--enable-prompt-tokens-details``. The same through real workers: tests/e2e/test_cached_tokens.py."""

from __future__ import annotations

import asyncio
import json
import types

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from omnirelay.gateway import generation
from omnirelay.gateway.app_keys import BUS, CONFIG
from omnirelay.gateway.config import GatewayConfig, ServedModel
from omnirelay.gateway.generation import Generation, TextChunk
from omnirelay.gateway.routes import choices, completions
from omnirelay.gateway.schema import parse_chat, parse_completion
from omnirelay.gateway.usage import UsageReport

PROMPT = [11, 12, 13, 14, 15]
CACHED = 3


class _Record:
    """What the renderers tell a request's record (gateway/request_record.py), unused here."""

    def tokens(self, count: int) -> None:
        pass

    def failed(self, error) -> None:
        raise AssertionError(error)


def _gen(request, tokens: int = 0, prompt: list[int] = PROMPT) -> Generation:
    return Generation(request_id="r", model=types.SimpleNamespace(name="m", stages=("prefill", "decode")),
                      request=request, prompt_token_ids=list(prompt), max_tokens=16, completion_tokens=tokens,
                      cached_tokens=CACHED)


def _scripted_run(pieces: list[tuple[str, list[int], str]]):
    """A stand-in for generation.run that counts tokens on the Generation as the real one does."""
    async def run(bus, gen, deadline):
        for text, ids, finish in pieces:
            gen.completion_tokens += len(ids)
            yield TextChunk(text, ids, finish)
    return run


async def _answer(tmp_path, handler, **flags) -> str:
    app = web.Application()
    app[CONFIG] = GatewayConfig(models=(ServedModel("m", str(tmp_path)),), **flags)
    app[BUS] = None   # the scripted runs never reach a bus
    app.router.add_post("/answer", handler)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        async with session.post(server.make_url("/answer"), timeout=aiohttp.ClientTimeout(total=30)) as reply:
            assert reply.status == 200, await reply.text()
            return await reply.text()


def _events(body: str) -> list[dict]:
    blocks = body.strip().split("\n\n")
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(block.removeprefix("data: ")) for block in blocks[:-1]]


def _one_choice(tmp_path, monkeypatch, request, pieces, **flags) -> list[dict] | dict:
    monkeypatch.setattr(generation, "run", _scripted_run(pieces))
    fmt = completions.ChatFormat() if request.kind == "chat" else completions.CompletionFormat()

    async def handler(http_request):
        gen = _gen(request)
        if request.stream:
            return await completions._stream(http_request, gen, fmt, _Record())
        return await completions._respond_full(http_request, gen, fmt, _Record())

    body = asyncio.run(_answer(tmp_path, handler, **flags))
    return _events(body) if request.stream else json.loads(body)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
PIECES = [("a", [1], ""), ("", [2], ""), ("bc", [3, 4], ""), ("d", [5], "length")]   # "": text held back


# ------------------------------------------------------------------ which chunks report (vLLM's should_include_usage)

@pytest.mark.parametrize("include, continuous, force, expected", [
    (False, False, False, (False, False)),
    (True, False, False, (True, False)),
    (True, True, False, (True, True)),
    (False, False, True, (True, True)),   # forced: on every chunk too, as vLLM 0.32
    (True, False, True, (True, True)),
])
def test_stream_options_under_the_force_flag(include, continuous, force, expected):
    report = UsageReport.of(include, include and continuous, force=force, details=False)
    assert (report.final, report.continuous) == expected


def test_continuous_usage_needs_include_usage():
    plain = parse_chat({**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert not plain.include_usage and not plain.continuous_usage
    report = UsageReport.of(plain.include_usage, plain.continuous_usage, force=False, details=False)
    assert not report.final and report.so_far(5, 1) is None


# ------------------------------------------------------------------ one choice

def test_continuous_usage_counts_this_stream_from_zero(tmp_path, monkeypatch):
    request = parse_chat({**CHAT, "stream": True, "stream_options": {"include_usage": True,
                                                                     "continuous_usage_stats": True}})
    events = _one_choice(tmp_path, monkeypatch, request, PIECES)
    role, *content, last = events
    # The role chunk goes out after the first tokens arrived; it reports none of them (vLLM: 0).
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert role["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    assert [c["usage"]["completion_tokens"] for c in content] == [1, 4, 5]   # the held-back token rides on
    assert all(c["usage"]["total_tokens"] == 5 + c["usage"]["completion_tokens"] for c in content)
    assert all("prompt_tokens_details" not in c["usage"] for c in [role, *content])
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}


def test_without_continuous_usage_content_chunks_have_no_usage_key(tmp_path, monkeypatch):
    request = parse_chat({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    *content, last = _one_choice(tmp_path, monkeypatch, request, PIECES)
    assert all("usage" not in c for c in content)
    assert last == {**last, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}}
    plain = _one_choice(tmp_path, monkeypatch, parse_chat({**CHAT, "stream": True}), PIECES)
    assert all("usage" not in c for c in plain) and plain[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_force_include_usage_reports_on_a_stream_that_did_not_ask(tmp_path, monkeypatch, kind):
    request = parse_chat({**CHAT, "stream": True}) if kind == "chat" else \
        parse_completion({"model": "m", "prompt": "hi", "stream": True})
    events = _one_choice(tmp_path, monkeypatch, request, PIECES, enable_force_include_usage=True)
    assert all("usage" in e for e in events)
    assert [e["usage"]["completion_tokens"] for e in events] == ([0] if kind == "chat" else []) + [1, 4, 5, 5]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 10


def test_prompt_tokens_details_only_with_its_flag(tmp_path, monkeypatch):
    asked = parse_chat({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    whole = parse_completion({"model": "m", "prompt": "hi"})
    # Off (vLLM's default): null in a JSON answer, left out of a stream's last chunk.
    assert _one_choice(tmp_path, monkeypatch, whole, PIECES)["usage"]["prompt_tokens_details"] is None
    assert "prompt_tokens_details" not in _one_choice(tmp_path, monkeypatch, asked, PIECES)[-1]["usage"]
    on = {"enable_prompt_tokens_details": True}
    details = {"cached_tokens": CACHED}
    assert _one_choice(tmp_path, monkeypatch, whole, PIECES, **on)["usage"]["prompt_tokens_details"] == details
    assert _one_choice(tmp_path, monkeypatch, asked, PIECES, **on)[-1]["usage"]["prompt_tokens_details"] == details


# ------------------------------------------------------------------ several choices

def _several(tmp_path, request, script, prompts: list[list[int]], **flags) -> list[dict]:
    """``script``: (choice index, token ids, finish) in arrival order, as choices.interleave yields them."""
    gens = [_gen(request, prompt=prompt) for prompt in prompts for _ in range(request.n)]
    plan = choices.Plan("r", request, gens, request.n)
    fmts = [completions.ChatFormat() if request.kind == "chat" else completions.CompletionFormat() for _ in gens]

    async def chunks():
        for index, ids, finish in script:
            gens[index].completion_tokens += len(ids)
            yield index, TextChunk("x" * len(ids), ids, finish)

    async def handler(http_request):
        return await choices._stream(http_request, plan, fmts, _Record(), chunks())

    return _events(asyncio.run(_answer(tmp_path, handler, **flags)))


def test_each_chunk_reports_its_own_choice(tmp_path):
    request = parse_chat({**CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True,
                                                                              "continuous_usage_stats": True}})
    script = [(0, [1], ""), (1, [7, 8], ""), (0, [2], ""), (1, [9], "length"), (0, [3, 4], "stop")]
    events = _several(tmp_path, request, script, [PROMPT], enable_prompt_tokens_details=True)
    roles, content, last = events[:2], events[2:-1], events[-1]
    assert [(e["choices"][0]["index"], e["usage"]["completion_tokens"]) for e in roles] == [(0, 0), (1, 0)]
    assert [(e["choices"][0]["index"], e["usage"]["completion_tokens"]) for e in content] == \
        [(0, 1), (1, 2), (0, 2), (1, 3), (0, 4)]
    assert {e["usage"]["prompt_tokens"] for e in events[:-1]} == {5}
    # The last chunk: the prompt once, every choice's tokens, and the details the flag asks for.
    assert last["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                             "prompt_tokens_details": {"cached_tokens": CACHED}}


def test_several_prompts_report_each_choice_with_its_own_prompt(tmp_path):
    request = parse_completion({"model": "m", "prompt": ["hi", "there"], "stream": True})
    script = [(1, [1, 2], ""), (0, [3], "length"), (1, [4], "stop")]
    events = _several(tmp_path, request, script, [PROMPT, PROMPT[:2]], enable_force_include_usage=True)
    assert [(e["choices"][0]["index"], e["usage"]["prompt_tokens"], e["usage"]["completion_tokens"])
            for e in events[:-1]] == [(1, 2, 2), (0, 5, 1), (1, 2, 3)]
    assert events[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
