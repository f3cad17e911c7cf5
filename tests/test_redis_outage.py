"""Redis stopped in the middle of transfers, under load, with the KV cache crossing from prefill to
decode through it.

The cluster's pipeline puts the ``kv`` edge on a real ``redis-server`` (started by the test, no
persistence). The load (as in ``test_faults.py``) runs once for the reference tokens, then again while
Redis is stopped (SIGTERM) for a few seconds and started again empty on the same port: puts fail
at once, gets already waiting ride out the outage, and a KV that died with the server is
re-made by starting the request over. Every request is classified completed (same tokens as the
fault-free run) / structured error / wrong / hung / unstructured / lost; the counts are printed and
the contract is 0 hung, 0 lost, 0 wrong. Afterwards the cluster serves normally and, at teardown,
Redis holds no key (``connector_servers`` records any that are left for the session leak check;
this test asserts it directly too).
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
import uuid

import openai
import pytest
import requests

from cluster import Cluster
from connector_servers import RedisServer

N_REQUESTS, CONCURRENCY, MAX_TOKENS, OUTAGE_S = 32, 8, 24, 3.0
REQUEST_TIMEOUT_S = 60.0
TOPICS = ["the sea", "a cat", "rain", "trains", "bread", "the moon", "music", "winter"]
PROMPTS = [f"Request {i}: say something about {TOPICS[i % len(TOPICS)]}." for i in range(N_REQUESTS)]

pytestmark = pytest.mark.slow


@pytest.fixture
def redis_cluster(tiny_model, tmp_path):
    pytest.importorskip("redis", reason="redis-py not installed (pip install 'omnirelay[redis]')")
    try:
        server = RedisServer(tmp_path)
        server.start()
    except (FileNotFoundError, RuntimeError) as exc:
        pytest.skip(f"redis-server unavailable: {exc}")
    pipeline = tmp_path / "redis-kv.yaml"
    pipeline.write_text(json.dumps({   # YAML is a superset of JSON
        "stages": [{"name": "prefill", "role": "prefill"}, {"name": "decode", "role": "decode"}],
        "connectors": {"kv": {"type": "redis", "options": {
            "url": server.url, "prefix": f"ortest-{uuid.uuid4().hex[:8]}:", "connect_timeout_s": 1.0,
            "socket_timeout_s": 2.0}}},
        "edges": [{"from": "prefill", "to": "decode", "connector": "kv"}]}))
    cluster = Cluster(model=tiny_model, log_dir=str(tmp_path))
    try:
        cluster.start_broker()
        cluster.start_worker("prefill", "--stage-configs-path", str(pipeline), "--capacity", "4")
        cluster.start_worker("decode", "--stage-configs-path", str(pipeline), "--capacity", "16")
        cluster.start_gateway("--stage-configs-path", str(pipeline))
        cluster.wait_healthy()
        cluster.redis = server
        yield cluster
    finally:
        cluster.stop()
        server.stop()


async def _one(client, prompt: str) -> tuple[str, list[int] | str]:
    try:
        response = await asyncio.wait_for(client.chat.completions.create(
            model="tiny-llm", messages=[{"role": "user", "content": prompt}], temperature=0,
            max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True, "return_token_ids": True}), REQUEST_TIMEOUT_S)
        return "completed", response.choices[0].model_extra["token_ids"]
    except asyncio.TimeoutError:
        return "hung", "no answer in time"
    except openai.APIStatusError as exc:
        # exc.body is only the inner "error" map; the contract is about the whole body.
        try:
            body = exc.response.json()
        except ValueError:
            body = {}
        structured = (isinstance(body.get("error"), dict) and {"message", "type", "param", "code"} <= set(body["error"])
                      and "request_id" in body and "stage" in body)
        return ("error" if structured else "unstructured"), f"{exc.status_code} {body}"


async def _load(url: str, fault=None, after: int = 8, n: int = N_REQUESTS) -> list:
    """Run ``n`` requests; call ``fault()`` (in a thread) once ``after`` of them have answered."""
    results: list = [None] * n
    done = 0
    fired = asyncio.Event()
    semaphore = asyncio.Semaphore(CONCURRENCY)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                  timeout=REQUEST_TIMEOUT_S + 5) as client:
        async def worker(i: int) -> None:
            nonlocal done
            async with semaphore:
                results[i] = await _one(client, PROMPTS[i])
            done += 1
            if fault is not None and done >= after and not fired.is_set():
                fired.set()
                await asyncio.to_thread(fault)

        await asyncio.gather(*(worker(i) for i in range(n)))
    return results


def _classify(results, baseline) -> dict[str, int]:
    counts = {"completed": 0, "error": 0, "wrong": 0, "hung": 0, "unstructured": 0, "lost": 0}
    for result, expected in zip(results, baseline):
        if result is None:
            counts["lost"] += 1
        elif result[0] == "completed":
            counts["completed" if result[1] == expected else "wrong"] += 1
        else:
            counts[result[0]] += 1
    return counts


def test_redis_stopped_mid_transfers_under_load(redis_cluster):
    redis = redis_cluster.redis
    baseline = [tokens for _, tokens in asyncio.run(_load(redis_cluster.url, n=N_REQUESTS))]
    assert redis.keys() == [], "the fault-free run left keys behind"
    outage: dict[str, float] = {}

    def stop_redis_then_start_it_again() -> None:
        redis.stop()   # SIGTERM to the PID we started, while transfers are in flight
        outage["stopped"] = time.monotonic()
        time.sleep(OUTAGE_S)
        redis.start()  # same port, empty: what it held is gone
        outage["back"] = time.monotonic()

    results = asyncio.run(_load(redis_cluster.url, fault=stop_redis_then_start_it_again, after=8, n=N_REQUESTS))
    counts = _classify(results, baseline)
    statuses = collections.Counter(result[1].split()[0] for result in results if result and result[0] != "completed")
    restarts = _broker(redis_cluster).get("request_restarts", 0)
    print(f"\nredis stopped {OUTAGE_S:.0f}s mid-transfers: {counts}; error statuses {dict(statuses)}; "
          f"{restarts} request(s) started over")
    assert counts["hung"] == 0 and counts["lost"] == 0 and counts["unstructured"] == 0, (counts, errors)
    assert counts["wrong"] == 0, counts
    assert counts["completed"] + counts["error"] == N_REQUESTS
    assert "500" not in statuses   # an outage is not a bug
    assert "back" in outage, "the outage never happened"
    # The outage touched the traffic (puts failed or requests started over), and the cluster serves again.
    logs = "".join(proc.output() for proc in redis_cluster.procs)
    assert counts["error"] > 0 or restarts > 0 or "unreachable" in logs, counts
    after = asyncio.run(_load(redis_cluster.url, n=8))
    assert _classify(after, baseline[:8])["completed"] == 8
    # Nothing is left in Redis once the requests are done (deletes are not left to the TTL).
    deadline = time.monotonic() + 5
    while redis.keys() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert redis.keys() == []


def _broker(cluster: Cluster) -> dict:
    return requests.get(cluster.url + "/cluster", timeout=10).json()["broker"]
