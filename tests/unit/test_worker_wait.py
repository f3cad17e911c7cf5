"""The gateway's wait for a role with no live worker (issue #45): ``--worker-wait`` seconds from the
first ``unavailable`` answer, never past the request's deadline (gateway/resubmit.py), on a clock we
move ourselves: every pause the policy takes advances it, nothing sleeps."""

from __future__ import annotations

import asyncio
import types

import pytest

from omnirelay.errors import Overloaded, Unavailable, WorkerLost
from omnirelay.gateway import resubmit
from omnirelay.gateway.bus import BusClient
from omnirelay.gateway.config import GatewayConfig


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(resubmit, "time", types.SimpleNamespace(monotonic=lambda: clock.now, time=lambda: clock.now))
    monkeypatch.setattr(resubmit, "asyncio", types.SimpleNamespace(sleep=clock.sleep))
    return clock


def _waited(wait: resubmit.AdmissionWait, clock: Clock, exc=None) -> float:
    """Seconds of pauses ``wait`` takes on repeated unavailable answers before it gives up."""
    start = clock.now
    for _ in range(10_000):   # bounded: each round pauses at least 0.2 s
        if not asyncio.run(wait.retry(exc or Unavailable("no live decode worker", retry_after=1.0))):
            return clock.now - start
    raise AssertionError("the wait never ended")


def test_a_request_waits_for_the_configured_time_from_the_first_unavailable_answer(clock):
    wait = resubmit.AdmissionWait(deadline=clock.now + 600, wait_s=30.0)
    assert 29.0 <= _waited(wait, clock) < 30.0
    wait.restart()                                   # got going again, then lost a worker: a new window
    assert 29.0 <= _waited(wait, clock) < 30.0


def test_the_wait_never_runs_past_the_request_deadline(clock):
    wait = resubmit.AdmissionWait(deadline=clock.now + 7.5, wait_s=30.0)
    assert 6.5 <= _waited(wait, clock) <= 7.5


def test_no_wait_for_other_errors_and_none_when_configured_off(clock):
    wait = resubmit.AdmissionWait(deadline=clock.now + 600, wait_s=30.0)
    for exc in (Overloaded("queue full", retry_after=1.0), WorkerLost("gone")):
        assert _waited(wait, clock, exc) == 0.0
    assert _waited(resubmit.AdmissionWait(deadline=clock.now + 600, wait_s=0.0), clock) == 0.0


def test_the_bus_client_carries_the_gateways_wait():
    assert GatewayConfig.worker_wait_s == 30.0

    async def scenario() -> None:
        bus = BusClient("tcp://127.0.0.1:1", worker_wait_s=12.5)   # no broker: nothing is sent
        try:
            assert resubmit.Submissions(bus, "r1", deadline=0.0)._admission.wait_s == 12.5
        finally:
            await bus.close()

    asyncio.run(scenario())
