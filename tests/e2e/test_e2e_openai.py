"""End to end through the official ``openai`` client against a real ``omni-serve``:
gateway → broker → prefill process → KV over shared memory → decode process → tokens to the gateway.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import requests

from cluster import settled_workers

MODEL = "tiny-llm"
PROMPTS = [
    "Hello there, how are you today?",
    "Write one sentence about the sea.",
    "List three colours.",
    "What is the capital of France?",
    "Tell me a short story about a cat and a dog.",
    "Why is the sky blue?",
    "Count from one to five.",
    "Describe a rainy morning in the city.",
]


def chat(client, content: str, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def test_chat_stream_equals_non_stream(client):
    full = chat(client, PROMPTS[0], temperature=0, max_tokens=32)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(chat(client, PROMPTS[0], temperature=0, max_tokens=32, stream=True,
                       stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completion_endpoint(client):
    full = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=12, temperature=0)
    assert full.object == "text_completion"
    assert full.usage.completion_tokens >= 1
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The weather today is", max_tokens=12, temperature=0, stream=True))
    assert streamed == full.choices[0].text


def test_streamed_token_ids_include_the_tokens_whose_text_is_held_back(client, server):
    """A stop string's prefix holds text back (it may yet become the stop): the chunks of those tokens
    carry no text, but with ``return_token_ids`` their ids still stream, so the streamed ids are the
    whole completion's."""
    kwargs = dict(model=MODEL, prompt="The weather today is", max_tokens=16, temperature=0,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0]
    ids = full.model_extra["token_ids"]
    assert len(ids) == 16
    text = requests.post(server.url + "/detokenize", json={"model": MODEL, "tokens": ids[6:8]}, timeout=10).json()
    held = {"stop": [text["prompt"] + "\u0000never"]}   # tokens 6 and 7 match its start; the stop never completes
    streamed, textless = [], 0
    for event in client.completions.create(stream=True, **kwargs, **held):
        choice = event.choices[0]
        streamed += choice.model_extra.get("token_ids") or []
        textless += bool(choice.model_extra.get("token_ids")) and not choice.text
    assert streamed == ids
    assert textless >= 1   # the case this test is for did happen
    per_choice: dict[int, list[int]] = {0: [], 1: []}   # the n > 1 fan-out streams the same way
    for event in client.completions.create(stream=True, n=2, **kwargs, **held):
        per_choice[event.choices[0].index] += event.choices[0].model_extra.get("token_ids") or []
    assert per_choice == {0: ids, 1: ids}


def test_greedy_equals_transformers(client, reference):
    for content in PROMPTS[:4]:
        response = chat(client, content, temperature=0, max_tokens=24, extra_body={"return_token_ids": True})
        assert response.choices[0].model_extra["token_ids"] == reference(content, 24), content


def test_greedy_equals_transformers_with_8_concurrent(server, reference):
    async def one(aclient, content):
        response = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=40,
            extra_body={"return_token_ids": True, "ignore_eos": True})
        return response.choices[0].model_extra["token_ids"]

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, c) for c in PROMPTS))

    results = asyncio.run(run_all())
    for content, tokens in zip(PROMPTS, results):
        assert len(tokens) == 40
        expected = reference(content, 40)
        # ignore_eos: transformers stops at EOS, we go on; compare up to its stop.
        assert tokens[: len(expected)] == expected, content


def _stats_by_role(server) -> dict[str, dict]:
    """The workers by role once every answered request is counted in their stats (they travel in
    heartbeats: :func:`settled_workers` waits for the cluster to say they are final)."""
    return {w["role"]: w for w in settled_workers(server.url)}


def test_kv_crosses_the_connector_between_processes(client, server):
    before = _stats_by_role(server)   # counters of earlier answers all in
    chat(client, PROMPTS[5], temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
    after = _stats_by_role(server)
    put = after["prefill"]["stats"].get("connector_bytes_put", 0) - before["prefill"]["stats"].get(
        "connector_bytes_put", 0)
    got = after["decode"]["stats"].get("connector_bytes_got", 0) - before["decode"]["stats"].get(
        "connector_bytes_got", 0)
    assert put > 0 and got == put
    assert after["prefill"]["pid"] != after["decode"]["pid"]
    assert {after["prefill"]["pid"], after["decode"]["pid"]} <= server.children


def test_seeded_sampling_is_reproducible(client):
    first = chat(client, PROMPTS[2], temperature=1.0, top_p=0.9, seed=1234, max_tokens=24,
                 extra_body={"top_k": 50, "ignore_eos": True})
    second = chat(client, PROMPTS[2], temperature=1.0, top_p=0.9, seed=1234, max_tokens=24,
                  extra_body={"top_k": 50, "ignore_eos": True})
    assert first.choices[0].message.content == second.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(
        client, PROMPTS[2], temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, stream=True,
        extra_body={"top_k": 50, "ignore_eos": True}))
    assert streamed == first.choices[0].message.content


def test_stop_string_truncates_and_stops(client):
    full = chat(client, PROMPTS[4], temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
    text = full.choices[0].message.content
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip()
    cut = chat(client, PROMPTS[4], temperature=0, max_tokens=40, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(
        client, PROMPTS[4], temperature=0, max_tokens=40, stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert streamed == cut.choices[0].message.content


def test_stop_token_and_max_tokens(client):
    response = chat(client, PROMPTS[1], temperature=0, max_tokens=5, extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 5


BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", b"[1, 2]", 400),
    ("/v1/chat/completions", {"model": MODEL}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "temperature": "hot"}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "", "content": "hi"}]}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400),
    ("/v1/chat/completions", {"model": 7, "messages": [{"role": "user", "content": "hi"}]}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1.5}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 99_999_999]}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 3000}, 400),
    ("/v1/nothing-here", {"model": MODEL}, 404),
]


@pytest.mark.parametrize("path,body,status", BAD_REQUESTS)
def test_bad_input_gets_openai_error(server, path, body, status):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = requests.post(server.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_server_keeps_serving_after_bad_input(client, server):
    for path, body, _ in BAD_REQUESTS[:6]:
        requests.post(server.url + path, data=body if isinstance(body, bytes) else json.dumps(body), timeout=30)
    assert chat(client, "still there?", temperature=0, max_tokens=4).choices[0].message.content is not None


def test_client_disconnect_frees_decode_kv(server):
    stats = _stats_by_role(server)["decode"]   # the effects of earlier tests all in (stop strings cancel too)
    total = stats["stats"]["kv_blocks_total"]
    cancelled_before = stats["stats"].get("cancelled", 0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[6]}], "max_tokens": 1500,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    decode = _stats_by_role(server)["decode"]   # settled: the cancel reached decode and a heartbeat says so
    assert decode["running"] == 0 and decode["free_kv_blocks"] == total
    assert decode["stats"]["cancelled"] == cancelled_before + 1   # stopped by the disconnect, not by finishing
