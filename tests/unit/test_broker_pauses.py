"""What the broker tells a gateway or worker that was silent past its liveness and came back (issue
#27, items 2-3), on the pure state machine with times we choose.

* A gateway given up gets a new ``HelloAck.session`` at its next hello: its requests were dropped
  (and counted), and the new session is how it learns to resume them.
* A worker dropped and back sends a burst before its Register: one ``Reregister`` answers it (per
  heartbeat interval), not one per message; its Register's ``held`` tasks are all cancelled, known
  or not, since the broker took every one of them back when it dropped the worker.

The end-to-end pauses (SIGSTOP/SIGCONT of real processes) are in ``test_pause_faults.py``.
"""

from __future__ import annotations

from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams
from omnirelay.broker.config import BrokerConfig
from omnirelay.broker.core import BrokerCore

FAR = 1e12
GW = b"gw"


def _core() -> BrokerCore:
    return BrokerCore(BrokerConfig(endpoint="ipc:///unused", heartbeat_interval_s=1.0, liveness_s=3.0))


def _worker(core: BrokerCore, identity: bytes, role: str, now: float = 0.0) -> None:
    core.on_message(identity, p.Register(identity.decode(), role, "m", 4), now)
    core.on_message(identity, p.Credit(identity.decode(), 4), now)


def _submit(core: BrokerCore, request_id: str, now: float, stages=("decode",)) -> list:
    return core.on_message(GW, p.Submit(request_id, "m", list(stages), [1, 2], TextParams(), FAR, "tcp://127.0.0.1:5555"), now)


def _session(core: BrokerCore, now: float) -> int:
    (ident, ack), = core.on_message(GW, p.GatewayHello("gw"), now)
    assert ident == GW and isinstance(ack, p.HelloAck) and ack.broker_id == core.broker_id
    return ack.session


def test_a_gateway_given_up_gets_a_new_session_when_it_says_hello_again():
    core = _core()
    _worker(core, b"dec", "decode")
    first = _session(core, 0.0)
    assert first > 0 and _session(core, 1.0) == first   # hellos within liveness: the same session
    _submit(core, "r1", 1.0)
    for t in (2.0, 3.0, 4.0):
        core.on_message(b"dec", p.Heartbeat("dec"), t)
    out = core.tick(4.5)                                   # paused: no hello for 3.5 s
    assert out == [(b"dec", p.CancelTask("r1"))]           # its request is stopped where it ran
    assert core.requests == {}
    assert (core.counters["gateways_expired"], core.counters["gateway_requests_dropped"]) == (1, 1)
    second = _session(core, 6.0)                           # back: told, by a new session
    assert second != first
    assert _session(core, 7.0) == second


def test_a_worker_back_from_a_pause_is_told_once_and_its_held_tasks_are_cancelled():
    core = _core()
    _worker(core, b"pre", "prefill")
    _worker(core, b"pre2", "prefill")
    _worker(core, b"dec", "decode")
    _submit(core, "r1", 0.0, stages=("prefill", "decode"))
    on = core.requests["r1"].worker_id
    other = b"pre2" if on == "pre" else b"pre"
    for t in (1.0, 2.0, 3.0):
        core.on_message(other, p.Heartbeat(other.decode()), t)
        core.on_message(b"dec", p.Heartbeat("dec"), t)
    out = core.tick(3.5)                                   # the worker holding r1 went silent
    assert [(i, m.request_id) for i, m in out if isinstance(m, p.Task)] == [(other, "r1")]   # re-dispatched

    ident = on.encode()
    burst = [p.StageDone(on, "r1", "prefill"), p.Credit(on, 1), p.Heartbeat(on)]
    answers = [out for msg in burst for out in core.on_message(ident, msg, 4.0)]
    assert answers == [(ident, p.Reregister("unknown worker"))]   # one, not one per message
    out = core.on_message(ident, p.Register(on, "prefill", "m", 4, held=["r1"]), 4.1)
    # r1 is alive (on the other worker) but no longer this one's: it is cancelled here.
    assert out == [(ident, p.CancelTask("r1"))]
    assert core.requests["r1"].worker_id == other.decode()
    # Dropped again later: told again.
    core.tick(9.0)
    assert core.on_message(ident, p.Heartbeat(on), 9.5) == [(ident, p.Reregister("unknown worker"))]


def test_the_brokers_own_silence_does_not_count_against_its_peers():
    core = _core()
    _worker(core, b"dec", "decode")
    _session(core, 0.0)
    core.forgive_silence(6.0)             # the daemon found its loop 6 s late
    assert core.tick(7.0) == []           # 7 s since anyone was heard, 1 s of it while the broker ran
    assert list(core.workers) == ["dec"] and GW in core.gateways
    assert core.counters["broker_stalls"] == 1
    core.tick(8.9)
    assert "dec" in core.workers          # 2.9 s of its own silence
    core.tick(9.1)
    assert "dec" not in core.workers      # 3.1 s, past liveness (3 s): dropped
