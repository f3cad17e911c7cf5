"""Tests for the broker: the pure state machine (``BrokerCore``), its config, and one real daemon.

The core is driven with fake identities (``b"w1"``, ``b"gw"``) and times we choose, so every
expiry and deadline is exact. The daemon test starts ``omni-broker`` as a subprocess and talks
ZeroMQ to it; every receive has a timeout and the process is always stopped.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys

import msgpack
import pytest
import zmq

from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams
from omnirelay.broker.config import BrokerConfig
from omnirelay.broker.core import BrokerCore
from omnirelay.broker.daemon import config_from_args, make_parser
from omnirelay.handoffs import KVHandoff

from zmq_dealers import Dealers

MODEL = "tiny"
GW = b"gw"
FAR = 1e9  # a deadline that never passes in these tests


@pytest.fixture
def core() -> BrokerCore:
    return BrokerCore(BrokerConfig(endpoint="ipc:///unused", heartbeat_interval_s=1.0, liveness_s=3.0,
                                   max_queue_per_role=2, max_attempts=3, retry_after_s=2.5))


def register(core, identity: bytes, role: str, capacity: int = 4, credits: int = 0, now: float = 0.0,
             model: str = MODEL) -> list:
    out = core.on_message(identity, p.Register(identity.decode(), role, model, capacity), now)
    if credits:
        out += core.on_message(identity, p.Credit(identity.decode(), credits), now)
    return out


def submit(core, request_id: str, stages=("prefill", "decode"), deadline: float = FAR, now: float = 0.0,
           model: str = MODEL) -> list:
    spec = p.Submit(request_id, model, list(stages), [1, 2, 3], TextParams(temperature=0.0), deadline,
                    "tcp://gw:7000", position_offset=0)
    return core.on_message(GW, spec, now)


def pipeline(core, pre_credits: int = 1, dec_credits: int = 1, **pre_kw) -> None:
    """Workers b"pre" (prefill) and b"dec" (decode); request r1 submitted, on b"pre" if it has credit."""
    register(core, b"pre", "prefill", credits=pre_credits, **pre_kw)
    register(core, b"dec", "decode", credits=dec_credits)
    submit(core, "r1")


def done(core, identity: bytes, request_id: str, stage: str, now: float = 0.0, **kw) -> list:
    return core.on_message(identity, p.StageDone(identity.decode(), request_id, stage, **kw), now)


def failed(core, identity: bytes, request_id: str, stage: str, error_type: str, now: float = 0.0,
           attempt: int = 0) -> list:
    return core.on_message(identity, p.StageFailed(identity.decode(), request_id, stage, error_type, "boom",
                                                   attempt=attempt), now)


def of_type(out: list, cls) -> list:
    return [(ident, msg) for ident, msg in out if isinstance(msg, cls)]


def tasks(out: list) -> list[tuple[bytes, str, str]]:
    return [(ident, msg.request_id, msg.stage) for ident, msg in of_type(out, p.Task)]


def failures(out: list) -> list[p.RequestFailed]:
    assert all(ident == GW for ident, _ in of_type(out, p.RequestFailed)), "failures go to the owning gateway"
    return [msg for _, msg in of_type(out, p.RequestFailed)]


# ------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("kwargs", [
    {"endpoint": "localhost:5555"},
    {"heartbeat_interval_s": 0},
    {"heartbeat_interval_s": 2.0, "liveness_s": 2.0},
    {"max_queue_per_role": 0},
    {"max_attempts": 0},
])
def test_config_rejects_invalid_values(kwargs):
    BrokerConfig()  # the defaults are valid
    with pytest.raises(ValueError):
        BrokerConfig(**kwargs)


def test_omni_broker_flags_set_the_retry_backoff():
    parser = make_parser()
    assert config_from_args(parser.parse_args([])) == BrokerConfig()
    config = config_from_args(parser.parse_args(["--retry-backoff", "0.5", "--retry-backoff-max", "8"]))
    assert (config.retry_backoff_s, config.retry_backoff_max_s) == (0.5, 8.0)
    assert config_from_args(parser.parse_args(["--retry-backoff", "0"])).retry_backoff_s == 0.0
    with pytest.raises(ValueError):   # main() turns this into a usage error (exit 2)
        config_from_args(parser.parse_args(["--retry-backoff", "2", "--retry-backoff-max", "1"]))


# ------------------------------------------------------------------------------------ membership


def test_register_is_silent_and_listed_in_status(core):
    assert register(core, b"w1", "prefill", capacity=-3) == []
    (worker,) = core.status(now=2.0).workers
    assert (worker["worker_id"], worker["role"], worker["model"]) == ("w1", "prefill", MODEL)
    assert worker["capacity"] == 0 and worker["credits"] == 0 and worker["last_seen_s"] == 2.0


def test_heartbeat_records_load_and_keeps_the_worker_alive(core):
    register(core, b"w1", "prefill")
    assert core.on_message(b"w1", p.Heartbeat("w1", running=2, waiting=5, free_kv_blocks=9,
                                              stats={"tok_s": 1.5}), 2.9) == []
    assert core.tick(5.0) == []  # 2.1 s after the heartbeat, within liveness (3.0)
    (worker,) = core.status(5.0).workers
    assert (worker["running"], worker["waiting"], worker["free_kv_blocks"], worker["stats"]) == (2, 5, 9, {"tok_s": 1.5})


@pytest.mark.parametrize("msg", [
    p.Credit("ghost", 1), p.Heartbeat("ghost"), p.StageDone("ghost", "r1", "prefill"),
    p.StageFailed("ghost", "r1", "prefill", "oom", "x")], ids=lambda m: type(m).__name__)
def test_unknown_worker_is_asked_to_reregister(core, msg):
    assert core.on_message(b"ghost", msg, 0.0) == [(b"ghost", p.Reregister("unknown worker"))]


def test_known_worker_id_from_another_identity_is_asked_to_reregister(core):
    register(core, b"w1", "prefill")
    assert core.on_message(b"impostor", p.Credit("w1", 4), 0.0) == [(b"impostor", p.Reregister("unknown worker"))]
    assert core.workers["w1"].credits == 0


def test_unregister_removes_the_worker_and_ignores_strangers(core):
    register(core, b"w1", "prefill")
    assert core.on_message(b"w9", p.Unregister("w9"), 0.0) == []
    assert core.on_message(b"w1", p.Unregister("w1"), 0.0) == []
    assert core.status(0.0).workers == []


def test_message_not_meant_for_the_broker_gets_an_error_reply(core):
    (reply,) = core.on_message(b"x", p.CancelTask("r1"), 0.0)
    assert reply[0] == b"x" and isinstance(reply[1], p.ErrorReply)
    assert reply[1].error_type == "unexpected_message"


def test_status_query_echoes_query_id_and_queue_depths(core):
    register(core, b"w1", "prefill")
    register(core, b"w2", "decode")
    submit(core, "r1")
    (reply,) = core.on_message(GW, p.StatusQuery(41), 0.0)
    assert reply[0] == GW and reply[1].query_id == 41
    assert reply[1].queued == {f"{MODEL}/prefill": 1}
    assert sorted(w["worker_id"] for w in reply[1].workers) == ["w1", "w2"]


# ------------------------------------------------------------------------------------ admission


@pytest.mark.parametrize("stages, model", [(("prefill", "decode"), MODEL), (("prefill",), "other")],
                         ids=["no-decode-worker", "unserved-model"])
def test_submit_without_a_live_worker_for_every_stage_is_unavailable(core, stages, model):
    register(core, b"w1", "prefill", credits=4)
    (reject,) = failures(submit(core, "r1", stages=stages, model=model))
    assert (reject.request_id, reject.stage, reject.error_type, reject.retry_after) == ("r1", "prefill", "unavailable", 2.5)
    assert "r1" not in core.requests and core.workers["w1"].tasks == set()


def test_submit_beyond_the_queue_bound_is_overloaded(core):
    register(core, b"w1", "prefill")  # no credit: everything queues
    assert submit(core, "r1", ("prefill",)) == [] and submit(core, "r2", ("prefill",)) == []
    (reject,) = failures(submit(core, "r3", ("prefill",)))
    assert (reject.error_type, reject.retry_after) == ("overloaded", 2.5)
    assert "r3" not in core.requests


def test_submit_is_overloaded_when_a_later_stage_queue_is_full(core):
    register(core, b"pre", "prefill", capacity=8, credits=8)
    register(core, b"dec", "decode")  # no credit: decode work queues up
    for rid in ("r1", "r2"):
        submit(core, rid)
        done(core, b"pre", rid, "prefill")
    assert core.status(0.0).queued[f"{MODEL}/decode"] == 2  # at the bound
    assert [f.error_type for f in failures(submit(core, "r3"))] == ["overloaded"]


@pytest.mark.parametrize("stages, request_id", [((), "new"), (("prefill",), "r1")], ids=["no-stages", "duplicate-id"])
def test_malformed_submissions_are_bad_requests(core, stages, request_id):
    register(core, b"w1", "prefill")
    submit(core, "r1", ("prefill",))
    (reject,) = failures(submit(core, request_id, stages))
    assert reject.error_type == "bad_request" and reject.retry_after == 0.0


# ------------------------------------------------------------------------------------ dispatch


def test_credit_releases_queued_work_as_a_complete_task(core):
    register(core, b"w1", "prefill")
    register(core, b"w2", "decode")
    assert submit(core, "r1") == []
    ((ident, task),) = core.on_message(b"w1", p.Credit("w1", 1), 1.0)
    assert ident == b"w1"
    assert task == p.Task(request_id="r1", stage="prefill", model=MODEL, prompt_token_ids=[1, 2, 3],
                          params=TextParams(temperature=0.0), inputs=None, reply_to="tcp://gw:7000", deadline=FAR,
                          attempt=0, position_offset=0)


def test_broker_never_sends_more_tasks_than_credits_granted(core):
    register(core, b"w1", "prefill", capacity=8, credits=2)
    sent = [t for rid in ("r1", "r2") for t in tasks(submit(core, rid, ("prefill",)))]
    assert sent == [(b"w1", "r1", "prefill"), (b"w1", "r2", "prefill")]
    assert tasks(submit(core, "r3", ("prefill",))) == []
    assert tasks(core.on_message(b"w1", p.Credit("w1", 1), 0.0)) == [(b"w1", "r3", "prefill")]


def test_credits_are_capped_at_the_workers_capacity(core):
    register(core, b"w1", "prefill", capacity=1, credits=10)
    assert core.workers["w1"].credits == 1
    assert len(tasks(submit(core, "r1", ("prefill",)))) == 1
    assert tasks(submit(core, "r2", ("prefill",))) == []


def test_dispatch_picks_the_least_loaded_worker(core):
    register(core, b"w1", "prefill", credits=3)
    register(core, b"w2", "prefill", credits=2)
    first = tasks(submit(core, "r1", ("prefill",)))
    second = tasks(submit(core, "r2", ("prefill",)))
    third = tasks(submit(core, "r3", ("prefill",)))
    assert first[0][0] == b"w1"   # equal load: the one with more credit
    assert second[0][0] == b"w2"  # w1 now holds a task
    assert third[0][0] == b"w1"   # one task each: w1 has more credit left


def test_tasks_go_only_to_workers_of_the_stage_role_and_model(core):
    register(core, b"other-model", "prefill", credits=4, model="big")
    register(core, b"dec", "decode", credits=4)
    register(core, b"pre", "prefill", credits=4)
    assert tasks(submit(core, "r1")) == [(b"pre", "r1", "prefill")]


# ------------------------------------------------------------------------------------ stages


def test_stage_done_hands_outputs_to_the_next_stage(core):
    pipeline(core)
    kv = KVHandoff("kv/r1/0", {"segment": "x"}, first_token=5)
    ((ident, task),) = done(core, b"pre", "r1", "prefill", outputs=kv)
    assert (ident, task.stage, task.inputs) == (b"dec", "decode", kv)
    assert core.workers["pre"].tasks == set()


def test_stage_done_on_the_last_stage_finishes_the_request(core):
    pipeline(core)
    done(core, b"pre", "r1", "prefill")
    assert done(core, b"dec", "r1", "decode") == []
    assert "r1" not in core.requests and core.counters["requests_finished"] == 1


def test_stage_done_with_finished_ends_the_request_early(core):
    pipeline(core)
    assert done(core, b"pre", "r1", "prefill", finished=True) == []  # e.g. max_tokens=1
    assert "r1" not in core.requests and core.workers["dec"].tasks == set()


@pytest.mark.parametrize("reporter, stage", [(b"pre2", "prefill"), (b"pre", "decode")],
                         ids=["not-the-holder", "wrong-stage"])
def test_stale_stage_done_is_ignored(core, reporter, stage):
    register(core, b"pre", "prefill", credits=1)
    register(core, b"pre2", "prefill")
    register(core, b"dec", "decode", credits=1)
    submit(core, "r1")
    assert done(core, reporter, "r1", stage) == []
    assert core.counters["stale_stage_reports"] == 1 and core.requests["r1"].worker_id == "pre"


def test_non_retryable_stage_failure_is_reported_to_the_gateway(core):
    pipeline(core)
    (fail,) = failures(failed(core, b"pre", "r1", "prefill", "out_of_memory"))
    assert (fail.request_id, fail.stage, fail.error_type, fail.message) == ("r1", "prefill", "out_of_memory", "boom")
    assert "r1" not in core.requests


def test_retryable_stage_failure_restarts_from_the_first_stage(core):
    pipeline(core, pre_credits=2)
    done(core, b"pre", "r1", "prefill", outputs=KVHandoff("kv/r1/0", {}, first_token=5))
    # worker_lost restarts at once; transfer_failed waits first (tests/faults/test_transfer_retry.py).
    out = failed(core, b"dec", "r1", "decode", "worker_lost")
    assert failures(out) == []
    ((ident, task),) = of_type(out, p.Task)
    assert (ident, task.stage, task.attempt, task.inputs) == (b"pre", "prefill", 1, None)


def test_retryable_failures_stop_after_max_attempts(core):
    pipeline(core, pre_credits=8, dec_credits=0, capacity=8)
    for attempt in (1, 2):  # max_attempts=3: two restarts, then the failure is final
        out = failed(core, b"pre", "r1", "prefill", "worker_lost", attempt=attempt - 1)
        assert tasks(out) == [(b"pre", "r1", "prefill")]
        assert core.requests["r1"].attempts == attempt
    # A late report of an attempt that was already restarted is ignored.
    assert failed(core, b"pre", "r1", "prefill", "worker_lost", attempt=0) == []
    (fail,) = failures(failed(core, b"pre", "r1", "prefill", "worker_lost", attempt=2))
    assert fail.error_type == "worker_lost" and "r1" not in core.requests


# ------------------------------------------------------------------------------------ cancel


def test_cancel_of_a_queued_request_removes_it_from_the_queue(core):
    register(core, b"pre", "prefill")
    submit(core, "r1", ("prefill",))
    assert core.on_message(GW, p.Cancel("r1"), 0.0) == []
    assert core.status(0.0).queued == {f"{MODEL}/prefill": 0}
    assert tasks(core.on_message(b"pre", p.Credit("pre", 1), 0.0)) == []
    assert core.on_message(GW, p.Cancel("r1"), 0.0) == []  # cancelling an unknown request is a no-op


def test_cancel_of_a_running_request_tells_its_worker(core):
    register(core, b"pre", "prefill", credits=1)
    submit(core, "r1", ("prefill",))
    assert core.on_message(GW, p.Cancel("r1", "client went away"), 0.0) == [(b"pre", p.CancelTask("r1"))]
    assert core.workers["pre"].tasks == set()
    assert done(core, b"pre", "r1", "prefill") == []  # a late report is stale


# ------------------------------------------------------------------------------------ worker loss


def test_silent_worker_expires_only_after_liveness(core):
    register(core, b"w1", "prefill", now=10.0)
    assert core.tick(13.0) == [] and "w1" in core.workers  # exactly liveness: still alive
    core.tick(13.01)
    assert "w1" not in core.workers and core.counters["workers_expired"] == 1


@pytest.mark.parametrize("loss", ["expiry", "unregister"])
def test_prefill_of_a_lost_worker_is_redispatched(core, loss):
    register(core, b"w1", "prefill", credits=1)
    register(core, b"w2", "prefill", credits=1, now=5.0)
    register(core, b"dec", "decode", now=5.0)
    submit(core, "r1")                                   # → w1 (tie on load: first registered)
    out = core.tick(4.0) if loss == "expiry" else core.on_message(b"w1", p.Unregister("w1"), 1.0)
    assert tasks(out) == [(b"w2", "r1", "prefill")] and failures(out) == []
    assert core.requests["r1"].attempts == 1 and "w1" not in core.workers


def test_prefill_is_not_redispatched_beyond_max_attempts(core):
    register(core, b"dec", "decode", now=100.0)
    for n in range(3):
        register(core, b"w%d" % n, "prefill", credits=1, now=10.0 * n)
    submit(core, "r1")                                   # → w0
    assert tasks(core.tick(4.0)) == [(b"w1", "r1", "prefill")]
    assert tasks(core.tick(14.0)) == [(b"w2", "r1", "prefill")]
    (fail,) = failures(core.tick(24.0))
    assert (fail.error_type, fail.resumable) == ("worker_lost", False)


def test_decode_of_a_lost_worker_fails_as_resumable(core):
    register(core, b"pre", "prefill", credits=1, now=100.0)
    register(core, b"dec1", "decode", credits=1)
    register(core, b"dec2", "decode", credits=1, now=100.0)
    submit(core, "r1")
    done(core, b"pre", "r1", "prefill", now=1.0)
    assert core.requests["r1"].worker_id == "dec1"
    (fail,) = failures(core.tick(4.0))
    assert (fail.stage, fail.error_type, fail.resumable) == ("decode", "worker_lost", True)
    assert "r1" not in core.requests


def test_losing_the_last_worker_of_a_role_fails_its_queue_as_unavailable(core):
    register(core, b"w1", "prefill")
    register(core, b"dec", "decode", now=100.0)
    submit(core, "r1")
    submit(core, "r2")
    # Leaving on purpose: not expected back (one dropped for silence is: test_broker_expected_back.py).
    out = failures(core.on_message(b"w1", p.Unregister("w1"), 1.0))
    assert sorted((f.request_id, f.error_type, f.retry_after) for f in out) == [
        ("r1", "unavailable", 2.5), ("r2", "unavailable", 2.5)]
    assert core.requests == {}


def test_expired_worker_reporting_late_is_told_to_reregister(core):
    register(core, b"w1", "prefill", credits=1)
    register(core, b"dec", "decode", now=100.0)
    submit(core, "r1")
    core.tick(4.0)
    assert done(core, b"w1", "r1", "prefill", now=4.5) == [(b"w1", p.Reregister("unknown worker"))]


def test_reregistering_the_only_worker_of_a_role_keeps_its_queue(core):
    register(core, b"w1", "prefill", credits=1)
    register(core, b"dec", "decode")
    submit(core, "r1")                                   # running on w1
    submit(core, "r2")                                   # queued behind it
    # Restarted: a worker's bus identity is its id, so it comes back from the same one.
    out = core.on_message(b"w1", p.Register("w1", "prefill", MODEL, 4), 1.0)
    assert [f for f in failures(out) if f.error_type == "unavailable"] == []
    assert sorted(rid for _, rid, _ in tasks(core.on_message(b"w1", p.Credit("w1", 2), 1.0))) == ["r1", "r2"]


def test_next_stage_without_a_live_worker_fails_unavailable(core):
    pipeline(core, dec_credits=0)
    core.on_message(b"dec", p.Unregister("dec"), 0.5)
    out = done(core, b"pre", "r1", "prefill", now=1.0)
    assert [(f.stage, f.error_type, f.retry_after) for f in failures(out)] == [("decode", "unavailable", 2.5)]


# ------------------------------------------------------------------------------------ deadlines


def test_queued_request_past_its_deadline_fails_and_leaves_the_queue(core):
    register(core, b"pre", "prefill")
    submit(core, "r1", ("prefill",), deadline=2.0)
    assert core.tick(2.0) == []
    (fail,) = failures(core.tick(2.5))
    assert (fail.error_type, fail.stage) == ("deadline_exceeded", "prefill")
    assert core.status(2.5).queued == {f"{MODEL}/prefill": 0}


def test_running_request_past_its_deadline_is_cancelled_on_its_worker(core):
    register(core, b"pre", "prefill", credits=1)
    submit(core, "r1", ("prefill",), deadline=2.0)
    out = core.on_message(b"pre", p.Heartbeat("pre"), 2.4) + core.tick(2.5)
    assert of_type(out, p.CancelTask) == [(b"pre", p.CancelTask("r1"))]
    assert [f.error_type for f in failures(out)] == ["deadline_exceeded"]


# ------------------------------------------------------------------------------------ the daemon process


def _recv(sock: zmq.Socket, timeout_s: float = 5.0) -> p.Message:
    assert sock.poll(int(timeout_s * 1000), zmq.POLLIN), "no reply within the timeout"
    return p.decode(sock.recv_multipart())


@pytest.mark.timeout(60)
def test_daemon_survives_garbage_and_dispatches_a_task(tmp_path):
    endpoint = f"ipc://{tmp_path}/b.sock"
    log_path = tmp_path / "broker.log"
    dealers = Dealers(endpoint)
    dealer = dealers.connect

    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "omnirelay.broker.daemon", "--endpoint", endpoint],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        gw = dealer(b"gw")
        gw.send_multipart(p.encode(p.StatusQuery(1)))
        assert _recv(gw, timeout_s=20) == p.StatusReply(1, [], {})

        rng = random.Random(5)
        garbage = [
            [rng.randbytes(64)],                                           # one frame
            [p.VERSION_FRAME, b"STQ"],                                             # two frames
            [p.VERSION_FRAME, b"STQ", msgpack.packb({"query_id": 1}), b"extra"],   # four frames
            [b"\x01", b"STQ", msgpack.packb({"query_id": 1})],             # wrong version
            [p.VERSION_FRAME, b"X" * 100_000, msgpack.packb({})],                  # huge unknown tag
            [p.VERSION_FRAME, b"STQ", b"\xc1\x92\xa3"],                            # not msgpack
            [p.VERSION_FRAME, b"STQ", msgpack.packb([1, 2])],                      # not a map
            [p.VERSION_FRAME, b"SUB", msgpack.packb({"request_id": 7})],           # invalid fields
            [b"", b"", b""],                                               # empty frames
            p.encode(p.CancelTask("r1")),                                  # valid, but not for the broker
        ] + [[rng.randbytes(rng.randint(0, 30)) for _ in range(rng.randint(1, 5))] for _ in range(100)]
        for frames in garbage:
            gw.send_multipart(frames)
        replies = [_recv(gw) for _ in garbage]
        assert all(isinstance(reply, p.ErrorReply) for reply in replies)
        assert {r.error_type for r in replies} == {"malformed_message", "unexpected_message"}

        worker = dealer(b"w1")
        for msg in (p.Register("w1", "prefill", MODEL, capacity=2), p.Credit("w1", 2), p.StatusQuery(2)):
            worker.send_multipart(p.encode(msg))
        status = _recv(worker)
        assert isinstance(status, p.StatusReply) and [w["worker_id"] for w in status.workers] == ["w1"]

        gw.send_multipart(p.encode(p.Submit("r1", MODEL, ["prefill"], [1, 2], TextParams(), FAR, "ipc://reply")))
        task = _recv(worker)
        assert isinstance(task, p.Task) and (task.request_id, task.stage, task.prompt_token_ids) == ("r1", "prefill", [1, 2])

        worker.send_multipart(p.encode(p.StageDone("w1", "r1", "prefill", finished=True)))
        worker.send_multipart(p.encode(p.StatusQuery(3)))  # same socket: handled after StageDone
        status = _recv(worker)
        assert status.query_id == 3 and status.workers[0]["assigned"] == 0

        # A burst: the broker sends a drain pass's replies together; all of them, in order.
        burst = dealer(b"w2")
        for msg in (p.Register("w2", "encode", MODEL, capacity=300), p.Credit("w2", 300), p.StatusQuery(4)):
            burst.send_multipart(p.encode(msg))
        assert _recv(burst).query_id == 4
        for i in range(300):
            gw.send_multipart(p.encode(p.Submit(f"b{i}", MODEL, ["encode"], [i], TextParams(), FAR, "ipc://reply")))
        assert [_recv(burst).request_id for _ in range(300)] == [f"b{i}" for i in range(300)]
        assert proc.poll() is None, "the broker exited"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    except BaseException:
        print("broker log:\n" + log_path.read_text()[-4000:])
        raise
    finally:
        dealers.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)


# ------------------------------------------------------------------------------------ gateways


def test_only_the_owning_gateway_may_cancel(core):
    pipeline(core, pre_credits=0)
    assert core.on_message(b"intruder", p.Cancel("r1"), 0.0) == []
    assert "r1" in core.requests
    core.on_message(GW, p.Cancel("r1"), 0.0)
    assert "r1" not in core.requests


def test_requests_of_a_silent_gateway_are_dropped_and_their_workers_told(core):
    core.on_message(GW, p.GatewayHello("gw"), 0.0)
    pipeline(core, pre_credits=1)
    assert core.requests["r1"].worker_id == "pre"
    for t in (1.0, 2.0, 3.0):   # the worker keeps heartbeating; the gateway says nothing more
        core.on_message(b"pre", p.Heartbeat("pre"), t)
        core.on_message(b"dec", p.Heartbeat("dec"), t)
    out = core.tick(core.config.liveness_s + 0.5)
    assert "r1" not in core.requests
    assert [(ident, msg.request_id) for ident, msg in of_type(out, p.CancelTask)] == [(b"pre", "r1")]


def test_non_finite_deadline_is_rejected(core):
    pipeline(core)
    (fail,) = failures(submit(core, "r2", deadline=float("nan")))
    assert fail.error_type == "bad_request"


def test_cancel_between_stages_tells_a_consumer_to_delete_the_handoff(core):
    pipeline(core, pre_credits=1, dec_credits=0)
    handles = KVHandoff("kv/r1/0", {"segment": "x"}, first_token=5)
    done(core, b"pre", "r1", "prefill", outputs=handles)          # queued for decode, no credit yet
    out = core.on_message(GW, p.Cancel("r1"), 0.0)
    (cancel,) = of_type(out, p.CancelTask)
    assert cancel[0] == b"dec" and cancel[1].inputs == handles


def test_stage_done_for_a_dead_request_asks_its_producer_to_delete_the_output(core):
    pipeline(core, pre_credits=1)
    core.on_message(GW, p.Cancel("r1"), 0.0)                       # cancelled while prefill runs
    outputs = KVHandoff("kv/r1/0", {}, first_token=3)
    out = done(core, b"pre", "r1", "prefill", outputs=outputs)
    assert [(ident, msg.inputs) for ident, msg in of_type(out, p.CancelTask)] == [(b"pre", outputs)]
