"""A connector slowed past the requests' deadline, under a bounded load.

The ``kv`` edge is the fault-injection connector over shared memory with every put delayed
``PUT_DELAY_S``; the prefill worker takes one request at a time (and, in the second case, eight:
see its xfail reason, a known defect). Through a gateway whose deadline is shorter than that
delay, 16 requests at concurrency 8 must each get a structured 504 in time (deadline + slack) — none hangs, none is
lost; through a second gateway with a deadline the link can meet, the same cluster answers every
request. Afterwards the decode worker is idle with its whole KV pool free and the late puts were
deleted rather than left for their TTL. Counts are printed per phase. (The single-request version,
with the exact timing of one 504, is ``test_fault_injection.py``.)
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import pytest
import requests

from cluster import Cluster

PUT_DELAY_S, SHORT_DEADLINE_S = 1.5, 1.0
N_REQUESTS, CONCURRENCY = 16, 8

pytestmark = pytest.mark.slow


@pytest.fixture
def slow_link(tiny_model, tmp_path, request):
    """``request.param``: the prefill worker's capacity (how many slow puts one engine step may make)."""
    pipeline = tmp_path / "slow.yaml"
    pipeline.write_text(json.dumps({   # YAML is a superset of JSON
        "stages": [{"name": "prefill", "role": "prefill"}, {"name": "decode", "role": "decode"}],
        "connectors": {"kv": {"type": "fault_injection",
                              "options": {"inner": "shared_memory", "put_delay_s": PUT_DELAY_S}}},
        "edges": [{"from": "prefill", "to": "decode", "connector": "kv"}]}))
    cluster = Cluster(model=tiny_model, log_dir=str(tmp_path))
    cluster.prefill = None
    try:
        cluster.start_broker()
        cluster.prefill = cluster.start_worker("prefill", "--stage-configs-path", str(pipeline), "--capacity",
                                               str(request.param))
        cluster.start_worker("decode", "--stage-configs-path", str(pipeline), "--capacity", "8")
        cluster.start_gateway("--request-timeout", str(SHORT_DEADLINE_S))
        cluster.short_url = cluster.url
        cluster.start_gateway("--request-timeout", "60")
        cluster.wait_healthy()
        yield cluster
    finally:
        cluster.stop()
        if request.param > 1 and cluster.prefill is not None:
            # The known defect (see the xfail) has the broker drop a live worker, so nobody tells it
            # to delete its late outputs and they stay published for a consumer that never comes.
            # Remove that one dead worker's segments, so the session's leak check stays meaningful.
            for name in os.listdir("/dev/shm"):
                if name.startswith(f"omnirelay-{cluster.prefill.pid}-") and not cluster.prefill.alive():
                    os.unlink(os.path.join("/dev/shm", name))


async def _load(url: str, timeout_s: float) -> list[tuple[str, float]]:
    """(outcome, seconds) per request: completed, error_<status> (structured), unstructured, hung."""
    results: list = [None] * N_REQUESTS
    semaphore = asyncio.Semaphore(CONCURRENCY)

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        body = {"model": "tiny-llm", "messages": [{"role": "user", "content": f"Request {i}"}], "max_tokens": 4,
                "temperature": 0, "ignore_eos": True}
        async with semaphore:
            started = time.monotonic()
            try:
                async with asyncio.timeout(timeout_s):
                    async with session.post(url + "/v1/chat/completions", json=body) as response:
                        answer = await response.json()
                if response.status == 200:
                    outcome = "completed" if answer["usage"]["completion_tokens"] == 4 else "wrong"
                elif isinstance(answer.get("error"), dict) and "request_id" in answer and "stage" in answer:
                    outcome = f"error_{response.status}"
                else:
                    outcome = "unstructured"
            except TimeoutError:
                outcome = "hung"
            results[i] = (outcome, time.monotonic() - started)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session, i) for i in range(N_REQUESTS)))
    return results


def _counts(results) -> dict[str, int]:
    counts: dict[str, int] = {"lost": results.count(None)}
    for outcome, _ in filter(None, results):
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def _segments_of(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"omnirelay-{pid}-")
            and "-c" not in name[len(f"omnirelay-{pid}"):]]   # buffer-pool files are reused, not per key


@pytest.mark.parametrize("slow_link", [
    1,
    pytest.param(8, marks=pytest.mark.xfail(strict=True, reason=(
        "the worker loop makes its connector puts inside the engine step, on the thread that also "
        "heartbeats: 8 puts of 1.5 s block it for 12 s, past the broker's 3.5 s liveness, so the broker "
        "drops the (healthy) prefill worker and the next requests get 503"))),
], indirect=True, ids=["one-put-per-step", "eight-puts-per-step"])
def test_slow_connector_past_the_deadline_under_load(slow_link):
    late = asyncio.run(_load(slow_link.short_url, timeout_s=30))
    counts = _counts(late)
    slowest = max(seconds for _, seconds in filter(None, late))
    print(f"\nconnector slowed {PUT_DELAY_S}s past a {SHORT_DEADLINE_S}s deadline: {counts}; slowest answer "
          f"{slowest:.2f}s")
    assert counts == {"lost": 0, "error_504": N_REQUESTS}, counts
    # Each 504 comes at the deadline, not after the slow put: a request's deadline starts at its
    # arrival, and with 8 at once each waits for no one.
    assert slowest < SHORT_DEADLINE_S + 1.5, slowest

    in_time = asyncio.run(_load(slow_link.url, timeout_s=60))
    counts = _counts(in_time)
    print(f"connector slowed {PUT_DELAY_S}s, deadline 60s: {counts}")
    assert counts == {"lost": 0, "completed": N_REQUESTS}, counts

    # Nothing is held afterwards: the decode worker is idle with its pool free, and the outputs
    # of the late puts were deleted once their stage reported done, not left for the TTL.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        [decode] = [w for w in requests.get(slow_link.url + "/cluster", timeout=10).json()["workers"]
                    if w["role"] == "decode"]
        if (decode["running"] == 0 and decode["free_kv_blocks"] == decode["stats"]["kv_blocks_total"]
                and not _segments_of(slow_link.prefill.pid)):
            break
        time.sleep(0.3)
    assert decode["running"] == 0 and decode["free_kv_blocks"] == decode["stats"]["kv_blocks_total"], decode
    assert _segments_of(slow_link.prefill.pid) == []
