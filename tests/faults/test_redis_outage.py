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
import functools
import json
import time
import uuid

import pytest

from cluster import Cluster, assert_contract, classify, greedy_chat, run_load
from connector_servers import started_redis

N_REQUESTS, CONCURRENCY, MAX_TOKENS, OUTAGE_S = 32, 8, 24, 3.0
REQUEST_TIMEOUT_S = 60.0

pytestmark = pytest.mark.slow


@pytest.fixture
def redis_cluster(tiny_model, tmp_path):
    server = started_redis(tmp_path)
    pipeline = tmp_path / "redis-kv.yaml"
    pipeline.write_text(json.dumps({   # YAML is a superset of JSON
        "stages": [{"name": "prefill", "role": "prefill"}, {"name": "decode", "role": "decode"}],
        "connectors": {"kv": {"type": "redis", "options": {
            "url": server.url, "prefix": f"ortest-{uuid.uuid4().hex[:8]}:", "connect_timeout_s": 1.0,
            "socket_timeout_s": 2.0}}},
        "edges": [{"from": "prefill", "to": "decode", "connector": "kv"}]}))
    with Cluster(model=tiny_model, log_dir=str(tmp_path)) as cluster:
        stage = ("--stage-configs-path", str(pipeline))
        cluster.start_llm(prefill=(*stage, "--capacity", "4"), decode=(*stage, "--capacity", "16"), gateway=stage)
        cluster.redis = server
        yield cluster
        server.stop()


def _load(url: str, fault=None, after: int = 8, n: int = N_REQUESTS) -> list:
    """Run ``n`` requests; call ``fault()`` (in a thread) once ``after`` of them have answered."""
    return asyncio.run(run_load(url, functools.partial(greedy_chat, max_tokens=MAX_TOKENS), n,
                                concurrency=CONCURRENCY, timeout_s=REQUEST_TIMEOUT_S, fault=fault, after=after))


def test_redis_stopped_mid_transfers_under_load(redis_cluster):
    redis = redis_cluster.redis
    baseline = [tokens for _, tokens in _load(redis_cluster.url, n=N_REQUESTS)]
    assert redis.keys() == [], "the fault-free run left keys behind"
    outage: dict[str, float] = {}

    def stop_redis_then_start_it_again() -> None:
        redis.stop()   # SIGTERM to the PID we started, while transfers are in flight
        outage["stopped"] = time.monotonic()
        time.sleep(OUTAGE_S)
        redis.start()  # same port, empty: what it held is gone
        outage["back"] = time.monotonic()

    results = _load(redis_cluster.url, fault=stop_redis_then_start_it_again, after=8, n=N_REQUESTS)
    counts = classify(results, baseline)
    statuses = collections.Counter(result[1].split()[0] for result in results if result and result[0] != "completed")
    restarts = redis_cluster.broker_counters().get("request_restarts", 0)
    print(f"\nredis stopped {OUTAGE_S:.0f}s mid-transfers: {counts}; error statuses {dict(statuses)}; "
          f"{restarts} request(s) started over")
    assert_contract(counts, results)
    assert "500" not in statuses   # an outage is not a bug
    assert "back" in outage, "the outage never happened"
    # The outage touched the traffic (puts failed or requests started over), and the cluster serves again.
    logs = redis_cluster.logs()
    assert counts["error"] > 0 or restarts > 0 or "unreachable" in logs, counts
    after = _load(redis_cluster.url, n=8)
    assert classify(after, baseline[:8])["completed"] == 8
    # Nothing is left in Redis once the requests are done (deletes are not left to the TTL).
    deadline = time.monotonic() + 5
    while redis.keys() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert redis.keys() == []
