"""A worker dropped for silence is expected back (issue #45, broker/expected.py), on the pure state
machine with times we choose.

While every worker of a role is expected back, the role's requests are held in its queue instead of
failed as ``unavailable``: admitted (bounded by the queue, as ever), dispatched when a worker of the
role registers and grants credit, failed with ``deadline_exceeded`` when their deadline passes first
(their hand-off deleted by a live worker), and failed as ``unavailable`` once no worker is expected
back any more. A worker that leaves on purpose (``Unregister``) is not expected back, and a role
with another live worker moves its requests there at once, as before.

The end-to-end pause (SIGSTOP of the only decode worker past the liveness, under streams) is in
``tests/faults/test_pause_faults.py``.
"""

from __future__ import annotations

import pytest

from omnirelay.broker import protocol as p
from omnirelay.broker.config import BrokerConfig
from omnirelay.broker.core import BrokerCore
from omnirelay.broker.daemon import config_from_args, make_parser
from omnirelay.handoffs import KVHandoff
from omnirelay.request_params import TextParams

MODEL = "m"
GW = b"gw"
FAR = 1e9
LIVENESS = 3.0
EXPECT = 20.0


def _core(**kw) -> BrokerCore:
    return BrokerCore(BrokerConfig(endpoint="ipc:///unused", heartbeat_interval_s=1.0, liveness_s=LIVENESS,
                                   expect_back_s=EXPECT, retry_after_s=2.5, **kw))


def _register(core: BrokerCore, identity: bytes, role: str, now: float, credits: int = 4, **kw) -> list:
    out = core.on_message(identity, p.Register(identity.decode(), role, MODEL, 4, **kw), now)
    return out + core.on_message(identity, p.Credit(identity.decode(), credits), now) if credits else out


def _submit(core: BrokerCore, request_id: str, now: float, stages=("prefill", "decode"), deadline=FAR) -> list:
    return core.on_message(GW, p.Submit(request_id, MODEL, list(stages), [1, 2, 3], TextParams(), deadline,
                                        "tcp://127.0.0.1:7000"), now)


def _alive(core: BrokerCore, identity: bytes, now: float) -> None:
    core.on_message(identity, p.Heartbeat(identity.decode()), now)


def _tasks(out: list) -> list[tuple[bytes, str, str]]:
    return [(ident, msg.request_id, msg.stage) for ident, msg in out if isinstance(msg, p.Task)]


def _failures(out: list) -> list[tuple[str, str, str]]:
    return [(msg.request_id, msg.error_type, msg.message) for _, msg in out if isinstance(msg, p.RequestFailed)]


def _kv(request_id: str) -> KVHandoff:
    return KVHandoff(f"kv/{request_id}/0", {"segment": request_id}, first_token=5)


def _silent_decode(core: BrokerCore, now: float = LIVENESS + 0.5) -> list:
    """b"pre" (prefill) stays alive; b"dec", the only decode worker, last heard at 0, is dropped at ``now``."""
    _alive(core, b"pre", now - 0.5)
    out = core.tick(now)
    assert "dec" not in core.workers and core.counters["workers_expired"] == 1
    return out


@pytest.fixture
def core() -> BrokerCore:
    core = _core()
    _register(core, b"pre", "prefill", 0.0)
    _register(core, b"dec", "decode", 0.0)
    return core


def test_a_stream_of_a_worker_dropped_for_silence_resumes_on_it_when_it_comes_back(core):
    """The decode stream fails as resumable (the gateway resubmits it); the resubmission's prefill
    runs, its decode waits for the worker and is dispatched to it once it registers again."""
    _submit(core, "r1", 0.0)
    assert _tasks(core.on_message(b"pre", p.StageDone("pre", "r1", "prefill", outputs=_kv("r1")), 0.1)) == [
        (b"dec", "r1", "decode")]
    out = _silent_decode(core)
    assert [(rid, error) for rid, error, _ in _failures(out)] == [("r1", "worker_lost")]
    assert [m.resumable for _, m in out if isinstance(m, p.RequestFailed)] == [True]

    assert _failures(_submit(core, "r1.1", 4.0)) == []                  # admitted, not unavailable
    out = core.on_message(b"pre", p.StageDone("pre", "r1.1", "prefill", outputs=_kv("r1.1")), 4.1)
    assert _failures(out) == [] and _tasks(out) == []                   # held in the decode queue
    assert core.status(4.1).queued[f"{MODEL}/decode"] == 1 and core.counters["requests_held"] == 1

    _alive(core, b"pre", 8.0)
    assert core.tick(9.0) == []                                         # still waiting, nothing failed
    # Back after a 10 s pause: told to register, registers (its old task cancelled), grants credit.
    assert core.on_message(b"dec", p.Heartbeat("dec"), 10.0) == [(b"dec", p.Reregister("unknown worker"))]
    out = core.on_message(b"dec", p.Register("dec", "decode", MODEL, 4, held=["r1"]), 10.1)
    assert out == [(b"dec", p.CancelTask("r1"))]
    out = core.on_message(b"dec", p.Credit("dec", 4), 10.2)
    assert _tasks(out) == [(b"dec", "r1.1", "decode")]
    (task,) = [m for _, m in out if isinstance(m, p.Task)]
    assert task.inputs == _kv("r1.1")                                    # the hand-off prefill left for it
    assert len(core.expected) == 0


def test_new_submissions_are_held_and_dispatched_in_order_when_a_worker_of_the_role_registers(core):
    _silent_decode(core)
    for i in range(3):
        assert _failures(_submit(core, f"r{i}", 5.0, stages=("decode",))) == []
    assert core.status(5.0).queued[f"{MODEL}/decode"] == 3
    # Another worker of the role (the supervisor started a new process, with a new id) serves them.
    _alive(core, b"pre", 6.0)
    assert _tasks(_register(core, b"dec-new", "decode", 6.5, credits=2)) == [
        (b"dec-new", "r0", "decode"), (b"dec-new", "r1", "decode")]
    assert _tasks(core.on_message(b"dec-new", p.Credit("dec-new", 1), 6.6)) == [(b"dec-new", "r2", "decode")]


def test_a_held_request_fails_at_its_deadline_and_its_handoff_is_deleted(core):
    _silent_decode(core)
    _submit(core, "r1", 4.0, deadline=10.0)
    core.on_message(b"pre", p.StageDone("pre", "r1", "prefill", outputs=_kv("r1")), 4.1)
    _alive(core, b"pre", 9.5)
    assert core.tick(10.0) == []                                          # at the deadline, not past it
    out = core.tick(10.5)
    assert _failures(out) == [("r1", "deadline_exceeded", "deadline passed while waiting for a decode worker "
                                                          "to come back")]
    # No decode worker is live to delete the KV prefill left: prefill's worker does.
    assert [(ident, m) for ident, m in out if isinstance(m, p.CancelTask)] == [
        (b"pre", p.CancelTask("r1", inputs=_kv("r1")))]
    assert core.requests == {} and core.status(10.5).queued[f"{MODEL}/decode"] == 0


def test_the_held_queue_is_bounded_and_admission_pushes_back_when_it_is_full():
    core = _core(max_queue_per_role=2)
    _register(core, b"dec", "decode", 0.0)
    _silent_decode(core)
    assert _failures(_submit(core, "r1", 4.0, stages=("decode",))) == []
    assert _failures(_submit(core, "r2", 4.0, stages=("decode",))) == []
    (refusal,) = [m for _, m in _submit(core, "r3", 4.0, stages=("decode",)) if isinstance(m, p.RequestFailed)]
    assert (refusal.error_type, refusal.message, refusal.retry_after) == ("overloaded", "decode queue is full", 2.5)


def test_when_no_worker_came_back_in_time_the_held_requests_fail_as_unavailable(core):
    _silent_decode(core)                                                  # dropped at 3.5: expected until 23.5
    _submit(core, "r1", 5.0)
    core.on_message(b"pre", p.StageDone("pre", "r1", "prefill", outputs=_kv("r1")), 5.1)
    for t in (10.0, 15.0, 20.0, 23.0):
        _alive(core, b"pre", t)
        assert _failures(core.tick(t)) == []
    out = core.tick(23.5)
    assert [(rid, error) for rid, error, _ in _failures(out)] == [("r1", "unavailable")]
    assert "none came back within 20s" in _failures(out)[0][2]
    (refusal,) = [m for _, m in _submit(core, "r2", 23.6) if isinstance(m, p.RequestFailed)]
    assert (refusal.error_type, refusal.retry_after) == ("unavailable", 2.5)   # nothing expected any more


def test_a_worker_that_leaves_on_purpose_is_not_expected_back(core):
    core.on_message(b"dec", p.Unregister("dec"), 1.0)
    (refusal,) = [m for _, m in _submit(core, "r1", 1.1) if isinstance(m, p.RequestFailed)]
    assert refusal.error_type == "unavailable"
    assert len(core.expected) == 0


def test_with_another_live_worker_of_the_role_requests_move_to_it_at_once(core):
    _register(core, b"pre2", "prefill", 0.0)
    _submit(core, "r1", 0.0, stages=("prefill",))                          # on b"pre" (registered first)
    _alive(core, b"pre2", 3.0)
    _alive(core, b"dec", 3.0)
    out = core.tick(3.5)                                                   # b"pre" was silent
    assert _tasks(out) == [(b"pre2", "r1", "prefill")] and _failures(out) == []
    assert core.counters["requests_held"] == 0


def test_without_expect_back_a_silent_drop_fails_the_role_at_once():
    core = BrokerCore(BrokerConfig(endpoint="ipc:///unused", heartbeat_interval_s=1.0, liveness_s=LIVENESS,
                                   expect_back_s=0.0))
    _register(core, b"dec", "decode", 0.0, credits=0)
    _submit(core, "r1", 0.0, stages=("decode",))
    assert [(rid, error) for rid, error, _ in _failures(core.tick(3.5))] == [("r1", "unavailable")]


def test_expect_back_is_a_broker_flag_and_is_checked():
    assert BrokerConfig().expect_back_s == 60.0
    assert config_from_args(make_parser().parse_args(["--expect-back", "12.5"])).expect_back_s == 12.5
    for bad in (-1.0, float("inf")):
        with pytest.raises(ValueError, match="expect_back_s"):
            BrokerConfig(expect_back_s=bad)
