"""The broker's side of a streamed hand-off (``StageStreaming``): the next stage starts while its
producer still runs, and the request lives until both have reported; losing either side fails the
request as resumable and tells the other worker to drop it. ``BrokerCore`` only, times chosen."""

from __future__ import annotations

import pytest

from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams
from omnirelay.broker.config import BrokerConfig
from omnirelay.broker.core import BrokerCore
from omnirelay.handoffs import ChunkStream, SpeechHandoff

from test_broker import FAR, GW, MODEL, done, failures, of_type, register, tasks

STAGES = ("decode", "generate")
STREAM = SpeechHandoff("speech/r1/0/prompt", reply_stream=ChunkStream("speech/r1/0/reply", max_chunks=6, window=2))


@pytest.fixture
def core() -> BrokerCore:
    core = BrokerCore(BrokerConfig(endpoint="ipc:///unused", heartbeat_interval_s=1.0, liveness_s=3.0,
                                   max_queue_per_role=4, max_attempts=3, retry_after_s=2.5))
    register(core, b"dec", "decode", credits=2)
    register(core, b"gen", "generate", credits=2)
    spec = p.Submit("r1", MODEL, list(STAGES), [1, 2, 3], TextParams(temperature=0.0), FAR, "tcp://gw:7000")
    assert tasks(core.on_message(GW, spec, 0.0)) == [(b"dec", "r1", "decode")]
    return core


def streaming(core, identity: bytes = b"dec", now: float = 0.1) -> list:
    return core.on_message(identity, p.StageStreaming(identity.decode(), "r1", "decode", STREAM), now)


def cancels(out: list) -> list[bytes]:
    return sorted(ident for ident, _ in of_type(out, p.CancelTask))


def test_the_next_stage_starts_on_the_stream_and_the_request_ends_with_both_reports(core):
    out = streaming(core)
    assert tasks(out) == [(b"gen", "r1", "generate")]
    assert of_type(out, p.Task)[0][1].inputs == STREAM
    assert core.requests["r1"].producer_id == "dec" and core.counters["streamed_handoffs"] == 1
    # The talker finishes first (it may stop before the thinker): the request waits for decode,
    # which is told to stop writing the stream nobody reads any more (its text goes on).
    out = done(core, b"gen", "r1", "generate", finished=True)
    assert [(ident, msg.streams_only) for ident, msg in of_type(out, p.CancelTask)] == [(b"dec", True)]
    assert "r1" in core.requests
    done(core, b"dec", "r1", "decode", finished=True)
    assert "r1" not in core.requests and core.counters["requests_finished"] == 1
    assert not core.workers["dec"].tasks and not core.workers["gen"].tasks


def test_the_producer_may_finish_before_its_consumer(core):
    """Their reports may cross: the producer's last chunks can be written after the consumer let go
    of what it had not read, so the former producer is told to delete what may be left."""
    streaming(core)
    done(core, b"dec", "r1", "decode", finished=True)
    assert "r1" in core.requests and core.requests["r1"].producer_id is None
    out = done(core, b"gen", "r1", "generate", finished=True)
    assert "r1" not in core.requests and core.counters["requests_finished"] == 1
    assert [(ident, msg.streams_only) for ident, msg in of_type(out, p.CancelTask)] == [(b"dec", True)]


def test_a_producer_lost_mid_stream_fails_the_request_as_resumable_and_stops_the_consumer(core):
    streaming(core)
    out = core.on_message(b"dec", p.Unregister("dec"), 0.2)
    [failure] = failures(out)
    assert failure.resumable and failure.error_type == "worker_lost" and failure.stage == "generate"
    assert cancels(out) == [b"gen"] and "r1" not in core.requests


def test_a_consumer_lost_mid_stream_is_not_replayed_alone(core):
    """Its chunks were read (and deleted): a generate retry elsewhere could not read them again. The
    producer stops, and with no generate worker left to delete what was not read, it deletes that too."""
    streaming(core)
    out = core.on_message(b"gen", p.Unregister("gen"), 0.2)
    [failure] = failures(out)
    assert failure.resumable and not tasks(out)
    assert [msg for _, msg in of_type(out, p.CancelTask)] == [p.CancelTask("r1"), p.CancelTask("r1", inputs=STREAM)]
    assert cancels(out) == [b"dec", b"dec"] and "r1" not in core.requests


def test_a_failed_consumer_stops_its_producer(core):
    streaming(core)
    out = core.on_message(b"gen", p.StageFailed("gen", "r1", "generate", "transfer_failed", "chunk lost"), 0.2)
    [failure] = failures(out)
    assert failure.error_type == "transfer_failed" and failure.resumable
    assert cancels(out) == [b"dec"] and not tasks(out)


def test_a_failed_producer_stops_its_consumer(core):
    streaming(core)
    out = core.on_message(b"dec", p.StageFailed("dec", "r1", "decode", "bad_request", "no"), 0.2)
    [failure] = failures(out)
    assert failure.error_type == "bad_request" and not failure.resumable
    assert cancels(out) == [b"gen"]


def test_a_cancel_reaches_both_workers(core):
    streaming(core)
    out = core.on_message(GW, p.Cancel("r1", "client left"), 0.2)
    assert cancels(out) == [b"dec", b"gen"] and "r1" not in core.requests


def test_a_stale_stream_report_has_its_producer_delete_what_it_wrote(core):
    streaming(core)
    out = core.on_message(b"dec", p.StageStreaming("dec", "r1", "decode", STREAM, attempt=7), 0.2)
    assert [(ident, msg.inputs) for ident, msg in of_type(out, p.CancelTask)] == [(b"dec", STREAM)]
    assert core.counters["stale_stage_reports"] == 1


def test_streaming_from_the_last_stage_is_stale(core):
    streaming(core)
    out = core.on_message(b"gen", p.StageStreaming("gen", "r1", "generate", STREAM), 0.2)
    assert cancels(out) == [b"gen"] and core.requests["r1"].worker_id == "gen"


def test_what_a_lost_consumer_did_not_read_is_deleted_by_another_worker_of_its_role(core):
    """The producer may be done (and no longer know the request): a live worker of the consuming
    role gets the hand-off to release, whatever the dead one read."""
    register(core, b"gen2", "generate", credits=1)
    streaming(core)
    done(core, b"dec", "r1", "decode", finished=True)
    out = core.on_message(b"gen", p.Unregister("gen"), 0.2)
    assert [(ident, msg.inputs) for ident, msg in of_type(out, p.CancelTask)] == [(b"gen2", STREAM)]
    assert failures(out)[0].resumable
