"""A connector slowed past the requests' deadline, under a bounded load.

The ``kv`` edge is the fault-injection connector over shared memory with every put delayed
``PUT_DELAY_S``; the prefill worker takes one request at a time, and in the second case eight, so
that up to eight slow puts (12 s, far past the broker's liveness of 3.5 s) are in flight at once — on
the prefill engine's transfer threads, while its loop keeps stepping and heartbeating.
Through a gateway whose deadline is shorter than that delay, 16 requests at concurrency 8 must each
get a structured 504 in time (deadline + slack) — none hangs, none is lost; through a second gateway
with a deadline the link can meet, the same cluster answers every request: no 503, because the
prefill worker stays registered all along (no step waits on a put, so the loop heartbeats itself;
a long step would be covered by the broker link, :mod:`omnirelay.workers.runtime.broker_link`). Afterwards the decode worker is idle with its whole KV pool
free and the late puts were deleted rather than left for their TTL. Counts are printed per phase.
(The single-request version, with the exact timing of one 504, is ``test_fault_injection.py``.)

``test_broker_link_*`` drive the link alone against a stand-in broker socket: keepalives while the
loop is busy, silence once it looks wedged, and the farewell relayed last on stop.
"""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import pytest
import requests
import zmq

from cluster import settled_workers
from kv_fault_support import kv_fault_cluster, kv_fault_pipeline, segments_of
from omnirelay.broker import protocol as p
from omnirelay.workers.runtime.broker_link import KEEPALIVE_AFTER, BrokerLink

PUT_DELAY_S, SHORT_DEADLINE_S = 1.5, 1.0
N_REQUESTS, CONCURRENCY = 16, 8

pytestmark = pytest.mark.slow


@pytest.fixture
def slow_link(tiny_model, tmp_path, request):
    """``request.param``: the prefill worker's capacity (how many slow puts one engine step may make)."""
    # One put per request (whole KV): the step's slow puts are what the test counts; a layerwise
    # export would make one per layer plus the manifest, each delayed.
    pipeline = kv_fault_pipeline(tmp_path / "slow.yaml", {"put_delay_s": PUT_DELAY_S},
                                 prefill_engine_args={"kv_transfer": "whole"})
    with kv_fault_cluster(tiny_model, str(tmp_path), pipeline, short_timeout_s=SHORT_DEADLINE_S, long_timeout_s=60,
                          prefill_args=("--capacity", str(request.param)), decode_args=("--capacity", "8")) as cluster:
        cluster.prefill_capacity = request.param
        yield cluster


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


def _prefill_view(cluster) -> tuple[dict, dict]:
    """The broker's record of the prefill worker, and its counters."""
    view = requests.get(cluster.url + "/cluster", timeout=10).json()
    [prefill] = [w for w in view["workers"] if w["role"] == "prefill"]
    return prefill, view["broker"]


@pytest.mark.parametrize("slow_link", [1, 8], indirect=True, ids=["one-put-per-step", "eight-puts-per-step"])
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

    # The prefill worker was never dropped: the same process, registered once, none expired.
    prefill, counters = _prefill_view(slow_link)
    print(f"prefill worker: keepalives {prefill['stats'].get('keepalives')}, broker counters {counters}")
    assert prefill["pid"] == slow_link.prefill.pid
    assert counters.get("workers_expired", 0) == 0 and counters["registrations"] == 2, counters
    # The slow puts ran on prefill's transfer threads, never inside an engine step: the loop sent its
    # own heartbeats all along, so the link never had a long step to speak for (its keepalives are
    # tested alone below).
    assert prefill["stats"]["keepalives"] == 0, prefill

    # Nothing is held afterwards: the decode worker is idle with its pool free, and the outputs
    # of the late puts were deleted once their stage reported done, not left for the TTL.
    # Decode's figures travel in heartbeats: read once the cluster says they are final. The segments
    # are the prefill process's own state (no heartbeat): polled, bounded, while its deletes run.
    [decode] = [w for w in settled_workers(slow_link.url) if w["role"] == "decode"]
    assert decode["running"] == 0 and decode["free_kv_blocks"] == decode["stats"]["kv_blocks_total"], decode
    deadline = time.monotonic() + 15
    while segments_of(slow_link.prefill.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert segments_of(slow_link.prefill.pid) == []


# ---------------------------------------------------------------------- the broker link alone

WORKER_ID, INTERVAL_S, WEDGED_S = "prefill-link-test", 0.1, 1.0


@pytest.fixture
def link_and_broker():
    """A started link, and the ROUTER socket standing in for the broker (the test is the loop thread)."""
    ctx = zmq.Context()
    broker = ctx.socket(zmq.ROUTER)
    broker.bind("inproc://stand-in-broker")
    link = BrokerLink(ctx, "inproc://stand-in-broker", WORKER_ID, INTERVAL_S, wedged_after_s=WEDGED_S)
    link.start()
    yield link, broker
    link.stop()
    broker.close(0)
    ctx.term()


def _received(broker: zmq.Socket, seconds: float) -> list[p.Message]:
    """What the stand-in broker gets from the worker within ``seconds``."""
    got = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if broker.poll(int(left * 1000) + 1):
            identity, *frames = broker.recv_multipart()
            assert identity == WORKER_ID.encode()
            got.append(p.decode(frames))
    return got


def test_broker_link_keeps_a_busy_loop_alive_and_gives_up_on_a_wedged_one(link_and_broker):
    link, broker = link_and_broker
    link.poll(0)   # the loop begins an iteration (an engine step with slow puts) …
    link.send_heartbeat(p.Heartbeat(WORKER_ID, running=3, waiting=1, free_kv_blocks=7, stats={"prefill_steps": 5},
                                    prefix_added=[11, 12]))
    first, *keepalives = _received(broker, WEDGED_S + 0.6)   # … and stays in it past the wedge limit
    assert first.prefix_added == [11, 12] and "step_age_s" not in first.stats
    print(f"\n{len(keepalives)} keepalives, step ages {[k.stats['step_age_s'] for k in keepalives]}")
    # One every KEEPALIVE_AFTER intervals (0.15 s) until the wedge limit; timing slack for a busy host.
    assert len(keepalives) >= 3 and link.keepalives == len(keepalives)
    for count, keepalive in enumerate(keepalives, start=1):
        assert (keepalive.running, keepalive.waiting, keepalive.free_kv_blocks) == (3, 1, 7)
        assert keepalive.prefix_added == [] and keepalive.prefix_evicted == [] and not keepalive.prefix_full
        assert keepalive.stats["prefill_steps"] == 5 and keepalive.stats["keepalives"] == count
    ages = [k.stats["step_age_s"] for k in keepalives]
    assert ages == sorted(ages) and ages[0] >= KEEPALIVE_AFTER * INTERVAL_S - 0.01 and ages[-1] <= WEDGED_S
    assert _received(broker, 0.5) == []   # wedged: the link no longer vouches for the loop

    # The loop comes back and reads what the broker said meanwhile.
    broker.send_multipart([WORKER_ID.encode(), *p.encode(p.Reregister("unknown worker"))])
    assert link.poll(2000)
    assert p.decode(link.recv()) == p.Reregister("unknown worker")
    assert link.recv() is None


def test_broker_link_relays_in_order_and_says_farewell_last(link_and_broker):
    link, broker = link_and_broker
    for n in range(1, 501):
        link.send(p.Credit(WORKER_ID, n))
    link.stop(farewell=p.Unregister(WORKER_ID))
    assert not [t for t in threading.enumerate() if t.name == "broker-link"]   # joined
    got = _received(broker, 1.0)
    assert got == [p.Credit(WORKER_ID, n) for n in range(1, 501)] + [p.Unregister(WORKER_ID)]
