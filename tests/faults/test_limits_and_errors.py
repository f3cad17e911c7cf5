"""The error contract and the limits: every status the gateway promises, produced for real.

One small cluster: a broker with short queues, a decode worker with a KV pool of a few blocks (to
provoke 507) and a gateway with tight limits. The 504 of a passed deadline is provoked
deterministically, with a connector slowed past it, in ``test_fault_injection.py``.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import requests

from cluster import Cluster

pytestmark = pytest.mark.slow
MODEL = "tiny-llm"
KV_BLOCK_BYTES = 2 * 4 * 16 * 2 * 64 * 4     # layers × block_size × kv_heads × head_dim × fp32, K and V


@pytest.fixture(scope="module")
def limited(tiny_model, tmp_path_factory):
    with Cluster(model=tiny_model, log_dir=str(tmp_path_factory.mktemp("limits"))) as cluster:
        # Decode's 10 blocks of 16 tokens (one kept back as padding): at most 144 tokens per sequence.
        cluster.start_llm(broker=("--max-queue-per-role", "8"), prefill=("--capacity", "2"),
                          decode=("--capacity", "4", "--kv-cache-bytes", str(10 * KV_BLOCK_BYTES)),
                          gateway=("--max-streams-per-client", "2", "--max-body-bytes", str(64 * 1024)))
        yield cluster


def _post(url: str, body, **kwargs) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(url + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"},
                         timeout=60, **kwargs)


def _chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def _assert_error(response: requests.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "request_id" in body and "stage" in body
    if code:
        assert body["error"]["code"] == code
    if status in (429, 503):
        assert int(response.headers["Retry-After"]) >= 1
    return body


def test_413_body_too_large(limited):
    _assert_error(_post(limited.url, _chat("x" * 100_000)), 413, "payload_too_large")


def test_422_for_what_we_do_not_do(limited):
    body = _assert_error(_post(limited.url, _chat("hi", use_beam_search=True)), 422, "unprocessable")
    assert body["error"]["param"] == "use_beam_search"
    _assert_error(_post(limited.url, _chat([{"type": "file", "file": {"file_id": "f"}}])), 422, "unprocessable")


def test_507_when_decode_runs_out_of_kv_and_the_worker_keeps_serving(limited):
    long_prompt = "word " * 170    # more tokens than the whole decode pool holds
    body = _assert_error(_post(limited.url, _chat(long_prompt, max_tokens=4)), 507, "out_of_memory")
    assert body["stage"] == "decode"
    ok = _post(limited.url, _chat("short", max_tokens=4, ignore_eos=True))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_429_beyond_the_streams_one_client_may_hold(limited):
    bodies = [_chat("stream please", max_tokens=100, ignore_eos=True, stream=True) for _ in range(3)]
    first = _post(limited.url, bodies[0], stream=True)
    second = _post(limited.url, bodies[1], stream=True)
    try:
        assert first.status_code == second.status_code == 200
        _assert_error(_post(limited.url, bodies[2]), 429, "overloaded")
    finally:
        first.close()
        second.close()


def test_1000_requests_against_a_small_queue_nothing_hangs(limited):
    """Admission rejects early (429/503 with Retry-After); every request gets an answer in time."""
    async def run() -> dict[str, int]:
        counts: dict[str, int] = {}
        semaphore = asyncio.Semaphore(100)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async def one(i: int) -> None:
                async with semaphore:
                    try:
                        async with session.post(limited.url + "/v1/chat/completions",
                                                json=_chat(f"request {i}", max_tokens=4, ignore_eos=True)) as resp:
                            body = await resp.json()
                            if resp.status == 200:
                                key = "completed" if body["usage"]["completion_tokens"] == 4 else "wrong"
                            elif "error" in body and "request_id" in body and (
                                    resp.status not in (429, 503) or "Retry-After" in resp.headers):
                                key = f"error_{resp.status}"
                            else:
                                key = "unstructured"
                    except asyncio.TimeoutError:
                        key = "hung"
                    counts[key] = counts.get(key, 0) + 1

            await asyncio.gather(*(one(i) for i in range(1000)))
        return counts

    counts = asyncio.run(run())
    print(f"\n1000 requests, queue 8: {counts}")
    assert sum(counts.values()) == 1000
    assert counts.get("hung", 0) == 0 and counts.get("wrong", 0) == 0 and counts.get("unstructured", 0) == 0
    assert counts.get("completed", 0) > 0 and counts.get("error_429", 0) > 0
    # After the storm the server still serves normally.
    assert _post(limited.url, _chat("after", max_tokens=2)).status_code == 200
