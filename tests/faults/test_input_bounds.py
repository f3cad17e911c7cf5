"""Every bad input bounded (issue #27, items 6 and 7), against real daemons serving the tiny LLM:

- malformed JSON of every kind the parser takes (nesting 10,000 deep, a 5,000-digit integer, integers
  past 64 bits in ``seed``/``top_k``/``stop_token_ids``, ``NaN``, a lone surrogate) is a 400 naming the
  param, over HTTP and as an error event on a WebSocket, whose session goes on;
- an exception no handler expected is an ``internal_error`` event and a log line, never a closed session;
- a request too big to serve (30,000 tools, a prompt longer than any that fits, more messages than the
  context has tokens) is refused before the work, and tokenizing a long text (``/tokenize``, which has no
  context to check against) runs off the event loop: another client's ``/health`` and a short chat are
  answered while it runs.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import urllib.parse

import aiohttp
import pytest
import requests
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from cluster import Cluster

MODEL = "tiny-llm"


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    with Cluster(model=tiny_model, log_dir=str(tmp_path_factory.mktemp("input-bounds"))) as cluster:
        cluster.start_llm()
        yield cluster


def _post(url: str, path: str, raw: str | bytes, timeout: float = 60) -> requests.Response:
    return requests.post(url + path, data=raw, headers={"Content-Type": "application/json"}, timeout=timeout)


def _chat_json(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "temperature": 0,
            **extra}


def _error(response: requests.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text[:500]
    return response.json()["error"]


# ------------------------------------------------------------------ item 7: bad JSON is a 400 naming the param

CHAT = json.dumps(_chat_json())
BAD_BODIES = {
    # name: (raw body, the param named; None where the whole body is at fault)
    "10,000-deep nesting": ('{"model": "tiny-llm", "messages": ' + "[" * 10000 + "]" * 10000 + "}", None),
    "200-deep nesting in a field": (CHAT[:-1] + ', "metadata": ' + "[" * 200 + "]" * 200 + "}", "metadata"),
    "a 5,000-digit integer": (CHAT[:-1] + ', "max_tokens": ' + "9" * 5000 + "}", "max_tokens"),
    "seed of 2**64": (CHAT[:-1] + f', "seed": {2 ** 64}' + "}", "seed"),
    "top_k of 2**63": (CHAT[:-1] + f', "top_k": {2 ** 63}' + "}", "top_k"),
    "a stop token id of 2**64": (CHAT[:-1] + f', "stop_token_ids": [1, {2 ** 64}]' + "}", "stop_token_ids[1]"),
    "NaN temperature": (CHAT.replace('"temperature": 0', '"temperature": NaN'), "temperature"),
    "a lone surrogate in content": (CHAT.replace('"Hello"', '"Hello \\ud800"'), "messages[0].content"),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_malformed_json_is_a_400_naming_the_param(cluster, name):
    raw, param = BAD_BODIES[name]
    error = _error(_post(cluster.url, "/v1/chat/completions", raw))
    assert error["param"] == param, error
    assert error["code"] == "bad_request"


def test_the_same_validator_guards_every_json_route(cluster):
    surrogate = '{"model": "tiny-llm", "prompt": "x\\udfff", "max_tokens": 1}'
    assert _error(_post(cluster.url, "/v1/completions", surrogate))["param"] == "prompt"
    assert _error(_post(cluster.url, "/tokenize", '{"prompt": "\\ud800"}'))["param"] == "prompt"
    assert _error(_post(cluster.url, "/detokenize", f'{{"tokens": [{2 ** 70}]}}'))["param"] == "tokens[0]"
    # and a good request still works after all of them
    assert requests.post(cluster.url + "/v1/chat/completions", json=_chat_json(), timeout=60).status_code == 200


async def _realtime_events(url: str, frames: list[str], until_types: list[str]) -> list[dict]:
    """Send ``frames`` on one /v1/realtime session, then read events until each of ``until_types`` was
    seen in order; every event read."""
    ws_url = url.replace("http://", "ws://") + "/v1/realtime?model=" + urllib.parse.quote(MODEL)
    events = []
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url) as ws:
        events.append(await ws.receive_json(timeout=60))   # session.created
        for frame in frames:
            await ws.send_str(frame)
        for kind in until_types:
            while True:
                event = await ws.receive_json(timeout=120)
                events.append(event)
                if event["type"] == kind:
                    break
    return events


def test_malformed_websocket_events_are_error_events_and_the_session_goes_on(cluster):
    deep = '{"type": "session.update", "session": ' + "[" * 10000 + "]" * 10000 + "}"
    wide = '{"type": "response.create", "response": {"max_output_tokens": ' + str(2 ** 64) + "}}"
    surrogate = json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}}).replace(
        '"x"', '"\\ud800"')
    hello = json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}})
    respond = json.dumps({"type": "response.create", "response": {"max_output_tokens": 2}})
    events = asyncio.run(_realtime_events(cluster.url, [deep, wide, surrogate, hello, respond],
                                          ["error", "error", "error", "conversation.item.done", "response.done"]))
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [e["param"] for e in errors] == [None, "response.max_output_tokens", "item.content[0].text"], errors
    assert all(e["code"] == "bad_request" for e in errors), errors
    assert events[-1]["response"]["status"] == "completed", events[-1]


def test_an_unexpected_exception_is_an_error_event_and_a_log_line(caplog):
    """EventSocket's catch-all, on a real aiohttp server and WebSocket: a handler that fails with what no
    one expected (a KeyError here) answers an internal_error event, logs the traceback, and the next event
    is served."""
    from omnirelay.gateway.app_keys import CONFIG
    from omnirelay.gateway.config import GatewayConfig, ServedModel
    from omnirelay.gateway.websocket_session import event_socket, install

    async def broken(event: dict) -> None:
        raise KeyError(event["missing"])

    async def route(request: web.Request) -> web.StreamResponse:
        async with event_socket(request, "test") as socket:
            async def echo(event: dict) -> None:
                await socket.send({"type": "echo"})
            await socket.serve({"broken": broken, "echo": echo}, busy=lambda: False)
        return socket.ws

    async def scenario(tmp: str) -> list[dict]:
        app = web.Application()
        app[CONFIG] = GatewayConfig(models=(ServedModel("m", tmp),))
        install(app)
        app.router.add_get("/ws", route)
        async with TestClient(TestServer(app)) as client, client.ws_connect("/ws") as ws:
            await ws.send_str('{"type": "broken", "event_id": "e1"}')
            await ws.send_str('{"type": "echo"}')
            return [await ws.receive_json(timeout=30), await ws.receive_json(timeout=30)]

    import tempfile
    with tempfile.TemporaryDirectory() as tmp, caplog.at_level("ERROR", logger="omnirelay.gateway"):
        first, second = asyncio.run(scenario(tmp))
    assert first["type"] == "error" and first["error"]["code"] == "internal_error", first
    assert first["error"]["event_id"] == "e1"
    assert second["type"] == "echo"
    assert any("event 'broken'" in r.getMessage() and r.exc_info for r in caplog.records), caplog.records


# ------------------------------------------------------------------ item 6: refused before the work, or off the loop


def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing",
                                              "parameters": {"type": "object", "properties": {}}}}
            for i in range(n)]


def test_thirty_thousand_tools_are_refused_before_they_are_parsed(cluster):
    response = requests.post(cluster.url + "/v1/chat/completions", json=_chat_json(tools=_tools(30000)), timeout=30)
    error = _error(response)
    assert error["param"] == "tools" and "128" in error["message"], error


def test_duplicate_tool_names_are_found_in_one_pass(cluster):
    tools = _tools(100) + _tools(1)
    error = _error(requests.post(cluster.url + "/v1/chat/completions", json=_chat_json(tools=tools), timeout=30))
    assert error["param"] == "tools[100].function.name" and "tool_0" in error["message"], error


def test_a_prompt_longer_than_any_that_fits_is_refused_before_tokenizing(cluster):
    long_chat = _chat_json(messages=[{"role": "user", "content": "word " * 1_500_000}])   # 7.5 MB
    error = _error(requests.post(cluster.url + "/v1/chat/completions", json=long_chat, timeout=30))
    assert error["param"] == "messages" and "characters" in error["message"], error
    error = _error(requests.post(cluster.url + "/v1/completions", timeout=30,
                                 json={"model": MODEL, "prompt": "word " * 1_500_000, "max_tokens": 1}))
    assert error["param"] == "prompt", error
    many = _chat_json(messages=[{"role": "user", "content": "hi"}] * 5000)   # the context has 2048 tokens
    error = _error(requests.post(cluster.url + "/v1/chat/completions", json=many, timeout=30))
    assert error["param"] == "messages" and "5000 messages" in error["message"], error


def test_tokenizing_a_long_text_leaves_the_gateway_answering(cluster):
    """/tokenize of ~7 MB (seconds of tokenizer work, bounded only by the body size): while it runs,
    another client's /health and a short chat are answered, and the long answer has not come yet.
    The long request is sent on a raw socket so the test knows its body has left before the others go."""
    body = json.dumps({"model": MODEL, "prompt": "river stone " * 600_000}).encode()   # 7.2 MB
    host, port = urllib.parse.urlsplit(cluster.url).hostname, urllib.parse.urlsplit(cluster.url).port
    head = (f"POST /tokenize HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection((host, port), timeout=120) as long_request:
        long_request.sendall(head + body)
        assert requests.get(cluster.url + "/health", timeout=60).status_code == 200
        chat = requests.post(cluster.url + "/v1/chat/completions", json=_chat_json(), timeout=60)
        assert chat.status_code == 200, chat.text
        readable, _, _ = select.select([long_request], [], [], 0)
        assert not readable, "the long /tokenize answered before a short chat sent after it: it held the loop"
        answer = b""
        while chunk := long_request.recv(1 << 20):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["count"] >= 1_200_000   # two words, at least a token each
