"""The broker's answer to "are the workers' figures final?" (``StatusReply.unsettled``, each worker's
``settled``), which tests wait on instead of sleeping across heartbeats.

A worker is settled when it holds and runs nothing and its last heartbeat counts every stage report
the broker received from it and every Task and CancelTask the broker sent it (``Heartbeat.reports``,
``Heartbeat.received``, on from where its ``Register`` said they stood). Driven on the pure core
with times we choose; the real processes are in the tests that read ``/cluster`` (tests/support/cluster.py's
``settled_workers``).
"""

from __future__ import annotations

import pytest

from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams
from omnirelay.broker.config import BrokerConfig
from omnirelay.broker.core import BrokerCore

MODEL = "tiny"
GW = b"gw"


@pytest.fixture
def core() -> BrokerCore:
    return BrokerCore(BrokerConfig(endpoint="ipc:///unused", heartbeat_interval_s=1.0, liveness_s=3.0))


def register(core: BrokerCore, name: str, role: str, **counts) -> None:
    core.on_message(name.encode(), p.Register(name, role, MODEL, 4, **counts), 0.0)
    core.on_message(name.encode(), p.Credit(name, 4), 0.0)


def beat(core: BrokerCore, name: str, reports: int, received: int, running: int = 0, **stats) -> None:
    core.on_message(name.encode(), p.Heartbeat(name, running=running, stats=stats, reports=reports,
                                               received=received), 0.0)


def submit(core: BrokerCore, request_id: str, stages=("prefill", "decode")) -> list:
    return core.on_message(GW, p.Submit(request_id, MODEL, list(stages), [1, 2, 3], TextParams(), 1e9, "tcp://gw:7000"), 0.0)


def settled(core: BrokerCore) -> dict[str, bool]:
    return {w["worker_id"]: w["settled"] for w in core.status(0.0).workers}


def test_a_worker_is_settled_once_a_heartbeat_counts_what_crossed_both_ways(core):
    register(core, "pre", "prefill")
    register(core, "dec", "decode")
    assert settled(core) == {"pre": False, "dec": False}   # no heartbeat yet: its stats are not known
    beat(core, "pre", 0, 0)
    beat(core, "dec", 0, 0)
    reply = core.status(0.0)
    assert (reply.requests, reply.unsettled) == (0, 0)

    submit(core, "r1")                                      # a Task to pre: it holds it
    assert settled(core) == {"pre": False, "dec": True}
    beat(core, "pre", 0, 0)                                  # made before the Task arrived
    assert not settled(core)["pre"]
    core.on_message(b"pre", p.StageDone("pre", "r1", "prefill"), 0.0)   # a Task to dec
    beat(core, "pre", 0, 1, prefill_tokens=3)               # made after the Task, before its report
    assert settled(core) == {"pre": False, "dec": False}
    beat(core, "pre", 1, 1, prefill_tokens=3)
    assert settled(core)["pre"]
    core.on_message(b"dec", p.StageDone("dec", "r1", "decode"), 0.0)
    beat(core, "dec", 1, 1, running=1)                      # counts it all but still says it runs one
    assert not settled(core)["dec"]
    beat(core, "dec", 1, 1)
    reply = core.status(0.0)
    assert (reply.requests, reply.unsettled) == (0, 0)
    assert {w["worker_id"]: w["stats"] for w in reply.workers} == {"pre": {"prefill_tokens": 3}, "dec": {}}


def test_a_cancel_is_settled_only_by_a_heartbeat_made_after_it(core):
    """The broker takes the task off the worker when the gateway cancels: without the count of the
    CancelTask, a heartbeat from before it (running 0 while the request waited) would look final."""
    register(core, "pre", "prefill")
    beat(core, "pre", 0, 0)
    submit(core, "r1", stages=("prefill",))
    beat(core, "pre", 0, 1)                                 # it has the task, waiting for room
    core.on_message(GW, p.Cancel("r1"), 0.0)
    reply = core.status(0.0)
    assert reply.requests == 0 and not settled(core)["pre"]
    beat(core, "pre", 0, 2, cancelled=1)
    assert settled(core)["pre"] and core.status(0.0).workers[0]["stats"] == {"cancelled": 1}


def test_counts_go_on_from_where_a_register_says_they_stood(core):
    """A worker registering again (the broker restarted, or dropped it) keeps counting over its life."""
    register(core, "pre", "prefill", reports=7, received=9)
    beat(core, "pre", 7, 9)
    assert settled(core)["pre"]
    submit(core, "r1", stages=("prefill",))
    core.on_message(b"pre", p.StageFailed("pre", "r1", "prefill", "bad_request", "no"), 0.0)
    beat(core, "pre", 7, 10)
    assert not settled(core)["pre"]
    beat(core, "pre", 8, 10)
    assert settled(core)["pre"]


def test_an_empty_broker_reports_nothing_unsettled(core):
    reply = core.status(0.0)
    assert (reply.workers, reply.requests, reply.unsettled) == ([], 0, 0)
