"""Usage reporting through real workers, as vLLM 0.32 reports it (gateway/usage.py), through the
official ``openai`` client: ``usage.prompt_tokens_details.cached_tokens`` — the prompt tokens prefill
took from its prefix cache, carried on the first token's ``TokenDelta.cached_tokens`` — in chat and
completions only with ``--enable-prompt-tokens-details`` (null without it; Responses'
``input_tokens_details`` always), a salted or scored prompt taking no cached prefix,
``--enable-force-include-usage`` (usage on a stream that did not ask) and ``GET /load`` with
``--enable-server-load-tracking``. This module's ``omni-serve`` runs with the three flags (one prefill
worker, prefix caching on); the session's runs without them. The renderers' chunk by chunk rules:
tests/unit/test_usage_reporting.py, tests/unit/test_server_load.py."""

from __future__ import annotations

import json
import socket
import urllib.parse
import uuid

import openai
import pytest
import requests

from omnirelay.broker import protocol as p

from conftest import ServeProcess

MODEL = "tiny-llm"


@pytest.fixture(scope="module")
def usage_server(tiny_model, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("usage") / "omni-serve.log")
    with ServeProcess(tiny_model, "--served-model-name", MODEL, "--log-level", "WARNING",
                      "--enable-prompt-tokens-details", "--enable-force-include-usage",
                      "--enable-server-load-tracking", log_path=log_path) as serve:
        yield serve


@pytest.fixture(scope="module")
def client(usage_server):
    return openai.OpenAI(base_url=usage_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _long_prompt() -> str:
    """About 200 tokens, new to the cache (a fresh id first, so no earlier test shares a block)."""
    return f"{uuid.uuid4().hex} " + " ".join(f"item {i} is the colour of the sea at dawn;" for i in range(20))


def _load(serve) -> int:
    reply = requests.get(serve.url + "/load", timeout=10)
    assert reply.status_code == 200
    return reply.json()["server_load"]


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
    # Streamed: the same count, on the usage chunk.
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


def test_a_scored_prompt_takes_no_cached_prefix(client):
    prompt = _long_prompt()

    def cached(**extra) -> int:
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached() == 0
    assert cached(prompt_logprobs=1) == 0   # prefill scores every prompt position: nothing taken from the cache
    assert cached() > 0


def test_cache_salt_shares_no_prefix(client):
    """Would fail if the salt were ignored: the same prompt under another salt finds its blocks cached."""
    prompt = f"{uuid.uuid4().hex} " + " ".join(f"line {i} of a long shared prefix;" for i in range(20))

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0 and cached(None) == 0   # another salt, or none: nothing shared
    assert cached("tenant-a") > 0                          # the same salt: its own prefix is reused


def test_without_the_flag_there_are_no_details(server):
    """The session's omni-serve, without --enable-prompt-tokens-details: vLLM's answers carry none."""
    plain = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": _long_prompt()}]
    for _ in range(2):   # the second finds its prefix cached, and still says nothing of it
        body = plain.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0).model_dump()
        assert "prompt_tokens_details" in body["usage"] and body["usage"]["prompt_tokens_details"] is None
    chunks = list(plain.completions.create(model=MODEL, prompt=_long_prompt(), max_tokens=2, stream=True,
                                           stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details is None
    # Responses always count them, as vLLM's do (input_tokens_details is not optional there).
    text = _long_prompt()
    plain.responses.create(model=MODEL, input=text, max_output_tokens=2, temperature=0)
    again = plain.responses.create(model=MODEL, input=text, max_output_tokens=2, temperature=0)
    assert again.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_forced_usage_on_a_stream_that_did_not_ask(client, route):
    if route == "chat":
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=5, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
    else:
        stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(chunk.usage is not None for chunk in chunks)   # vLLM: forced usage is continuous too
    completion = [chunk.usage.completion_tokens for chunk in chunks]
    assert completion == sorted(completion) and completion[-1] == 5
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5


def _half_sent(serve) -> tuple[socket.socket, bytes]:
    """A completion whose body is half sent: its handler has started (it reads the body) and runs
    until the rest arrives. Returns the socket and the rest."""
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
    url = urllib.parse.urlsplit(serve.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body[:5])
    return sock, body[5:]


def test_load_counts_the_requests_in_flight(usage_server, server):
    assert _load(usage_server) == 0
    sock, rest = _half_sent(usage_server)
    with sock:
        # Asked until the handler has started (the server reads the head first): no sleep, a bounded wait.
        assert any(_load(usage_server) == 1 for _ in range(500))
        sock.sendall(rest)
        assert sock.makefile("rb").readline().startswith(b"HTTP/1.1 200")
    assert _load(usage_server) == 0   # a JSON answer leaves the count before it is written
    # Without --enable-server-load-tracking, /load is there (as in vLLM) and counts nothing.
    sock, rest = _half_sent(server)
    with sock:
        assert _load(server) == 0
        sock.sendall(rest)
        assert sock.makefile("rb").readline().startswith(b"HTTP/1.1 200")
    assert _load(server) == 0
