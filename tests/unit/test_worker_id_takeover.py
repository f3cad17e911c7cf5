"""A worker id registered and alive cannot be re-registered from another bus identity (issue #27,
item 10). A worker's bus identity is its id (the broker link sets it), so a worker that restarts
comes back from the same identity and re-registers as before; a ``Register`` of a live worker's id
from any other connection is refused with ``ErrorReply`` and changes nothing. Once the worker has
been silent past the broker's liveness, its id is free again.

Before: the claimant took the live worker's slot and was sent its next task.
"""

from __future__ import annotations

from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams
from omnirelay.broker.config import BrokerConfig
from omnirelay.broker.core import BrokerCore

FAR = 1e12
LIVENESS = 3.0


def _core() -> BrokerCore:
    core = BrokerCore(BrokerConfig(endpoint="ipc:///unused", heartbeat_interval_s=1.0, liveness_s=LIVENESS))
    core.on_message(b"w1", p.Register("w1", "prefill", "m", 4), 0.0)
    core.on_message(b"w1", p.Credit("w1", 4), 0.0)
    return core


def _submit(core: BrokerCore, request_id: str, now: float) -> list:
    return core.on_message(b"gw", p.Submit(request_id, "m", ["prefill"], [1, 2], TextParams(), FAR, "tcp://127.0.0.1:5555"), now)


def test_a_live_worker_id_from_another_identity_is_refused():
    core = _core()
    core.on_message(b"w1", p.Heartbeat("w1"), 2.0)
    out = core.on_message(b"rogue", p.Register("w1", "prefill", "m", 4), 4.0)   # 2 s after its heartbeat
    assert [(ident, type(msg), msg.error_type) for ident, msg in out] == [(b"rogue", p.ErrorReply, "bad_request")]
    assert "w1" in out[0][1].message
    assert core.workers["w1"].identity == b"w1"
    assert core.counters["rejected_registrations"] == 1
    # The claimant's credit is not the worker's: told it is unknown; the work still goes to w1.
    assert core.on_message(b"rogue", p.Credit("w1", 4), 4.0) == [(b"rogue", p.Reregister("unknown worker"))]
    assert [(ident, type(msg)) for ident, msg in _submit(core, "r1", 4.0)] == [(b"w1", p.Task)]


def test_the_same_identity_registers_again():
    """A restarted worker (same id, same identity) takes its slot back at once."""
    core = _core()
    core.on_message(b"w1", p.Register("w1", "prefill", "m", 4), 1.0)
    core.on_message(b"w1", p.Credit("w1", 2), 1.0)
    assert core.counters["rejected_registrations"] == 0
    assert [(ident, type(msg)) for ident, msg in _submit(core, "r1", 1.0)] == [(b"w1", p.Task)]


def test_an_id_silent_past_liveness_may_be_taken():
    core = _core()
    out = core.on_message(b"w1-host-b", p.Register("w1", "prefill", "m", 4), LIVENESS + 0.5)
    assert not [msg for _, msg in out if isinstance(msg, p.ErrorReply)]
    core.on_message(b"w1-host-b", p.Credit("w1", 2), LIVENESS + 0.5)
    assert [(ident, type(msg)) for ident, msg in _submit(core, "r1", LIVENESS + 0.5)] == [(b"w1-host-b", p.Task)]
