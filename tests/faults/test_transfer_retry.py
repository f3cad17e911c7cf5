"""A failed transfer: the broker restarts the request after a growing, capped delay that never runs
past the deadline, and a client whose request ran out of attempts gets a 502 with Retry-After.

The first half drives :class:`BrokerCore` with times we choose (every delay exact); the second
starts a broker, a prefill and a decode worker whose KV connector fails every ``get``, and gateways
with a long and a short request timeout, and checks what an HTTP client sees.
"""

from __future__ import annotations

import time

import pytest
import requests

from kv_fault_support import kv_fault_cluster, kv_fault_pipeline
from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams
from omnirelay.broker.config import BrokerConfig
from omnirelay.broker.core import BrokerCore
from omnirelay.handoffs import KVHandoff

MODEL = "tiny"
GW = b"gw"
FAR = 1e9


@pytest.fixture
def core() -> BrokerCore:
    return BrokerCore(BrokerConfig(endpoint="ipc:///unused", max_attempts=5, retry_after_s=1.5,
                                   retry_backoff_s=0.25, retry_backoff_max_s=0.6))


def _start(core: BrokerCore, deadline: float = FAR, request_id: str = "r1") -> None:
    """Workers b"pre" and b"dec" with plenty of credit; ``request_id`` runs its prefill on b"pre"."""
    if "pre" not in core.workers:
        for identity, role in ((b"pre", "prefill"), (b"dec", "decode")):
            core.on_message(identity, p.Register(identity.decode(), role, MODEL, 8), 0.0)
            core.on_message(identity, p.Credit(identity.decode(), 8), 0.0)
    out = core.on_message(GW, p.Submit(request_id, MODEL, ["prefill", "decode"], [1, 2, 3], TextParams(), deadline,
                                       "tcp://gw:1"), 0.0)
    assert _tasks(out) == [("pre", request_id, 0)]


def _fail_transfer(core: BrokerCore, now: float, attempt: int, request_id: str = "r1") -> list:
    """b"pre" finishes the prefill of ``attempt``; b"dec" then cannot fetch its KV."""
    out = core.on_message(b"pre", p.StageDone("pre", request_id, "prefill", outputs=KVHandoff("k", {}, first_token=1), attempt=attempt),
                          now)
    assert _tasks(out) == [("dec", request_id, attempt)]
    return core.on_message(b"dec", p.StageFailed("dec", request_id, "decode", "transfer_failed", "store is down",
                                                 attempt=attempt), now)


def _tasks(out: list) -> list[tuple[str, str, int]]:
    return [(ident.decode(), msg.request_id, msg.attempt) for ident, msg in out if isinstance(msg, p.Task)]


def _failures(out: list) -> list[p.RequestFailed]:
    return [msg for ident, msg in out if isinstance(msg, p.RequestFailed) and ident == GW]


def test_restart_after_a_failed_transfer_waits_doubling_up_to_the_cap(core):
    _start(core)
    now = 0.0
    for attempt, delay in enumerate((0.25, 0.5, 0.6, 0.6), start=1):   # base 0.25, doubling, cap 0.6
        assert _fail_transfer(core, now, attempt - 1) == []             # nothing re-dispatched at once
        assert core.requests["r1"].phase.value == "backoff"
        assert core.tick(now + delay - 0.01) == []
        out = core.tick(now + delay)
        assert _tasks(out) == [("pre", "r1", attempt)]
        (task,) = [msg for _, msg in out if isinstance(msg, p.Task)]
        assert task.stage == "prefill" and task.inputs is None   # from the first stage, the lost KV forgotten
        now += delay
    assert core.counters["restart_backoffs"] == core.counters["request_restarts"] == 4
    # The fifth attempt was the last: the failure reaches the gateway with a retry-after hint.
    (fail,) = _failures(_fail_transfer(core, now, 4))
    assert (fail.error_type, fail.stage, fail.message) == ("transfer_failed", "decode", "store is down")
    assert fail.retry_after >= 1.5 and "r1" not in core.requests


def test_a_message_between_ticks_releases_a_due_restart(core):
    _start(core)
    _fail_transfer(core, 10.0, 0)
    assert core.on_message(b"dec", p.Heartbeat("dec"), 10.1) == []
    out = core.on_message(b"dec", p.Heartbeat("dec"), 10.3)
    assert _tasks(out) == [("pre", "r1", 1)]


def test_a_restart_goes_ahead_of_requests_queued_while_it_waited(core):
    _start(core)
    # b"pre" spends its credit on r1's first attempt plus seven others.
    for i in range(7):
        core.on_message(GW, p.Submit(f"other{i}", MODEL, ["prefill", "decode"], [1], TextParams(), FAR, "tcp://gw:1"), 0.0)
    _fail_transfer(core, 0.0, 0)
    core.on_message(GW, p.Submit("late", MODEL, ["prefill", "decode"], [1], TextParams(), FAR, "tcp://gw:1"), 0.1)
    assert core.tick(0.3) == []   # due, but no credit: queued in front of "late"
    out = core.on_message(b"pre", p.Credit("pre", 2), 0.4)
    assert [request_id for _, request_id, _ in _tasks(out)] == ["r1", "late"]


def test_a_wait_that_would_end_past_the_deadline_fails_at_once_as_deadline_exceeded(core):
    _start(core, deadline=0.2)
    (fail,) = _failures(_fail_transfer(core, 0.0, 0))
    assert (fail.error_type, fail.stage) == ("deadline_exceeded", "decode")
    assert "store is down" in fail.message and "r1" not in core.requests
    assert core.tick(1.0) == []


def test_a_deadline_passing_while_waiting_fails_the_request(core):
    _start(core, deadline=0.3)
    assert _fail_transfer(core, 0.0, 0) == []      # 0.25 < 0.3: it waits
    out = core.tick(0.31)                          # the tick came late: the deadline won
    assert _tasks(out) == []
    (fail,) = _failures(out)
    assert fail.error_type == "deadline_exceeded" and "waiting to retry" in fail.message
    assert "r1" not in core.requests and core.tick(1.0) == []


def test_a_request_cancelled_while_waiting_is_never_dispatched_again(core):
    _start(core)
    _fail_transfer(core, 0.0, 0)
    assert core.on_message(GW, p.Cancel("r1"), 0.1) == []   # no worker holds it: nobody to tell
    assert "r1" not in core.requests
    assert core.tick(1.0) == []
    # The same id submitted anew runs its own course; the old wait does not touch it.
    _start(core, request_id="r1")
    assert core.tick(2.0) == [] and core.requests["r1"].phase.value == "running"


def test_worker_lost_restarts_at_once(core):
    _start(core)
    out = core.on_message(b"pre", p.StageFailed("pre", "r1", "prefill", "worker_lost", "draining"), 0.0)
    assert _tasks(out) == [("pre", "r1", 1)]


def test_zero_backoff_restarts_at_once():
    core = BrokerCore(BrokerConfig(endpoint="ipc:///unused", retry_backoff_s=0.0))
    _start(core)
    assert _tasks(_fail_transfer(core, 0.0, 0)) == [("pre", "r1", 1)]


@pytest.mark.parametrize("kwargs", [{"retry_backoff_s": -0.1}, {"retry_backoff_s": 2.0, "retry_backoff_max_s": 1.0},
                                    {"retry_backoff_max_s": float("inf")}, {"retry_backoff_s": float("nan")}])
def test_config_rejects_invalid_backoff(kwargs):
    with pytest.raises(ValueError):
        BrokerConfig(**kwargs)


# ------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def failing_store(tiny_model, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("transfer-retry")
    pipeline = kv_fault_pipeline(tmp_path / "failing.yaml", {"fail_every_nth_get": 1})
    # 0.7 s leaves room for the first restart (after 0.25 s) but never for the second (0.5 s more).
    with kv_fault_cluster(tiny_model, str(tmp_path), pipeline, short_timeout_s=0.7, long_timeout_s=30) as cluster:
        yield cluster


def _chat(url: str) -> requests.Response:
    body = {"model": "tiny-llm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
            "temperature": 0}
    return requests.post(url + "/v1/chat/completions", json=body, timeout=60)


def _broker_counters(url: str) -> dict:
    return requests.get(url + "/cluster", timeout=10).json()["broker"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_502_with_retry_after_once_the_restarts_are_spent(failing_store):
    before = _broker_counters(failing_store.url)
    started = time.monotonic()
    response = _chat(failing_store.url)
    elapsed = time.monotonic() - started
    assert response.status_code == 502, response.text
    body = response.json()
    assert body["error"]["code"] == "transfer_failed" and body["error"]["type"] == "server_error"
    assert body["request_id"] and body["stage"] == "decode"
    assert int(response.headers["Retry-After"]) >= 1
    after = _broker_counters(failing_store.url)
    # max_attempts 3: two restarts, each after its wait (0.25 s, then 0.5 s).
    assert after.get("restart_backoffs", 0) - before.get("restart_backoffs", 0) == 2
    assert after["request_restarts"] - before.get("request_restarts", 0) == 2
    assert elapsed >= 0.75, f"the restarts did not wait: the 502 came after {elapsed:.2f}s"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_504_when_the_deadline_leaves_no_time_for_the_next_restart(failing_store):
    _chat(failing_store.url)   # warm: the short deadline is meant for the waits, not for a cold start
    started = time.monotonic()
    response = _chat(failing_store.short_url)
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text
    body = response.json()
    assert body["error"]["code"] == "deadline_exceeded" and body["request_id"]
    assert "retry" in body["error"]["message"], body   # it ended in (or instead of) a wait, not in a stage
    assert "Retry-After" not in response.headers
    assert elapsed < 0.7 + 1.0, f"the 504 took {elapsed:.2f}s"
