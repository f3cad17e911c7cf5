"""One token message per gateway per step: DecodeRole and PrefillRole batch a step's deltas by
``reply_to`` into a ``TokenDeltas`` (the same helper), and the gateway's bus hands each delta to its
stream as if it came alone.

The role is driven by a stand-in engine (the batching is about messages, not about the model); the
bus test pushes real frames over ZeroMQ into a real :class:`BusClient`.
"""

from __future__ import annotations

import asyncio
import time

import zmq

from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams
from omnirelay.gateway.bus import BusClient, RequestStream
from omnirelay.handoffs import KVHandoff, SpeechHandoff
from omnirelay.workers.llm.requests import EngineStep, TokenOut
from omnirelay.workers.runtime.engine import RequestFailure
from omnirelay.workers.runtime.roles import BROKER
from omnirelay.workers.llm.roles import DecodeRole, PrefillRole

GW_A, GW_B = "tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"


class ScriptedEngine:
    """Returns the given step outputs, one per ``step()``."""

    connector = None
    prefix_caching = False   # what a PrefillRole reads to declare (or not) a prefix cache to the loop

    def __init__(self, *steps: EngineStep):
        self._steps = list(steps)

    def step(self) -> EngineStep:
        return self._steps.pop(0)

    def add(self, task) -> None:
        pass


def test_a_step_sends_one_message_per_gateway_then_its_reports():
    speech_outputs = SpeechHandoff("speech/a3/0/prompt", {}, "speech/a3/0/reply", {})
    step = EngineStep(
        tokens=[TokenOut("a1", GW_A, 5, 11, ""), TokenOut("b1", GW_B, 9, 21, ""),
                TokenOut("a2", GW_A, 7, 12, "stop", done=True),
                TokenOut("a3", GW_A, 2, 13, "length", speech_outputs, done=True, speech_next=True)],
        failed=[RequestFailure("a4", "deadline_exceeded", "deadline passed in decode")])
    role = DecodeRole("dec-1", ScriptedEngine(step))
    out = role.step()

    assert [dest for dest, _ in out] == [GW_A, GW_B, BROKER, BROKER, BROKER]
    batched, single = out[0][1], out[1][1]
    assert type(batched) is p.TokenDeltas and batched.worker_id == "dec-1"
    assert batched.deltas == [p.TokenDelta("a1", 5, [11]), p.TokenDelta("a2", 7, [12], "stop"),
                              p.TokenDelta("a3", 2, [13], "length")]
    # A gateway with one stream in the step gets a plain TokenDelta, as before batching existed.
    assert single == p.TokenDelta("b1", 9, [21], "", "dec-1")
    # Stage reports follow every token message, in the order the requests finished.
    done_a2, done_a3, failed = (msg for _, msg in out[2:])
    assert (type(done_a2), done_a2.request_id, done_a2.finished, done_a2.outputs) == (p.StageDone, "a2", True, None)
    assert (done_a3.request_id, done_a3.finished, done_a3.outputs) == ("a3", False, speech_outputs)
    assert (type(failed), failed.request_id, failed.error_type) == (p.StageFailed, "a4", "deadline_exceeded")
    for _, msg in out:   # everything the role produces survives the wire
        assert p.decode(p.encode(msg)) == msg


def test_a_step_without_tokens_sends_no_token_message():
    role = DecodeRole("dec-1", ScriptedEngine(EngineStep()))
    assert role.step() == []


def _prefill_role(step: EngineStep, gateways: dict[str, str]) -> PrefillRole:
    """A prefill role holding tasks ``request_id → reply_to`` (attempt 1), whose next step yields ``step``."""
    role = PrefillRole("pre-1", ScriptedEngine(step))
    for rid, reply_to in gateways.items():
        assert role.accept(p.Task(rid, "prefill", "m", [1, 2, 3], TextParams(), None, reply_to, time.time() + 60, attempt=1)) == []
    return role


def test_prefill_first_tokens_for_one_gateway_go_as_one_message_before_the_reports():
    kv = KVHandoff("kv/a1/1", {}, first_token=11)
    step = EngineStep([TokenOut("a1", "", 0, 11, "", kv, done=True), TokenOut("a3", "", 0, 13, "stop", done=True),
                       TokenOut("a4", "", 0, 14, "", KVHandoff("kv/a4/1", {}, 14), done=True)],
                      [RequestFailure("a2", "out_of_memory", "too long")])
    role = _prefill_role(step, {rid: GW_A for rid in ("a1", "a2", "a3", "a4")})
    out = role.step()

    # The first tokens, then the StageDone reports in step order (each after its request's token),
    # then the failure.
    assert [dest for dest, _ in out] == [GW_A, BROKER, BROKER, BROKER, BROKER]
    batched = out[0][1]
    assert type(batched) is p.TokenDeltas and batched.worker_id == "pre-1"
    assert batched.deltas == [p.TokenDelta("a1", 0, [11]), p.TokenDelta("a3", 0, [13], "stop"),
                              p.TokenDelta("a4", 0, [14])]
    done_a1, done_a3, done_a4, failed = (msg for _, msg in out[1:])
    assert [(type(m), m.request_id, m.finished, m.attempt) for m in (done_a1, done_a3, done_a4)] == [
        (p.StageDone, "a1", False, 1), (p.StageDone, "a3", True, 1), (p.StageDone, "a4", False, 1)]
    assert done_a1.outputs == kv and done_a1.stage == "prefill"
    assert (type(failed), failed.request_id, failed.error_type, failed.attempt) == (p.StageFailed, "a2",
                                                                                     "out_of_memory", 1)
    for _, msg in out:
        assert p.decode(p.encode(msg)) == msg


def test_prefill_first_tokens_for_two_gateways_go_as_one_message_each():
    step = EngineStep([TokenOut("a1", "", 0, 11, done=True), TokenOut("b1", "", 0, 21, done=True),
                       TokenOut("b2", "", 0, 22, "length", done=True)])
    role = _prefill_role(step, {"a1": GW_A, "b1": GW_B, "b2": GW_B})
    out = role.step()

    assert [dest for dest, _ in out] == [GW_A, GW_B, BROKER, BROKER, BROKER]
    # A gateway with one request in the step gets a plain TokenDelta, as before batching existed.
    assert out[0][1] == p.TokenDelta("a1", 0, [11], "", "pre-1")
    assert out[1][1] == p.TokenDeltas([p.TokenDelta("b1", 0, [21]), p.TokenDelta("b2", 0, [22], "length")], "pre-1")
    assert [msg.request_id for _, msg in out[2:]] == ["a1", "b1", "b2"]
    # No StageDone before the message carrying that request's first token.
    sent: set[str] = set()
    for _, msg in out:
        if isinstance(msg, p.StageDone):
            assert msg.request_id in sent
        else:
            sent.update(d.request_id for d in (msg.deltas if isinstance(msg, p.TokenDeltas) else [msg]))


def test_an_early_first_token_goes_to_the_gateway_and_the_report_follows_alone():
    """A first token sent ahead of its hand-off (not done) leaves at once; the later done output
    (token_sent) brings only the StageDone, never the token a second time."""
    kv = KVHandoff("kv/a1/1", {}, first_token=11)
    role = PrefillRole("pre-1", ScriptedEngine(EngineStep([TokenOut("a1", "", 0, 11)]),
                                               EngineStep([TokenOut("a1", "", 0, 11, "", kv, done=True,
                                                                    token_sent=True)])))
    assert role.accept(p.Task("a1", "prefill", "m", [1, 2, 3], TextParams(), None, GW_A, time.time() + 60, attempt=1)) == []
    assert role.step() == [(GW_A, p.TokenDelta("a1", 0, [11], "", "pre-1"))]
    ((dest, done),) = role.step()
    assert dest == BROKER and (type(done), done.request_id, done.outputs, done.attempt) == (p.StageDone, "a1", kv, 1)


async def _collect(stream: RequestStream) -> list[tuple[list[int], str]]:
    return [(event.tokens, event.finish_reason) async for event in stream.events()]


async def _bus_receives_batched_deltas():
    bus = BusClient("tcp://127.0.0.1:1")   # no broker: only the token socket is exercised
    await bus.start()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    try:
        deadline = time.time() + 10
        streams = {}
        for rid in ("x", "y"):
            submit = p.Submit(rid, "m", ["decode"], [1], TextParams(), deadline, bus.reply_to)
            streams[rid] = await bus.submit(submit)
        push.connect(bus.reply_to)
        # Out of order, a duplicate, a request this gateway does not know: each delta is handled
        # exactly as a lone TokenDelta would be.
        for msg in (p.TokenDeltas([p.TokenDelta("x", 1, [101]), p.TokenDelta("y", 0, [200]),
                                   p.TokenDelta("gone", 0, [1])], "dec-1"),
                    p.TokenDeltas([p.TokenDelta("x", 0, [100]), p.TokenDelta("y", 0, [200])], "dec-1"),
                    p.TokenDelta("y", 1, [201], "stop", "dec-1"),
                    p.TokenDeltas([p.TokenDelta("x", 2, [102], "length")], "dec-1")):
            push.send_multipart(p.encode(msg))
        got = await asyncio.wait_for(asyncio.gather(_collect(streams["x"]), _collect(streams["y"])), 10)
        assert got[0] == [([100, 101], ""), ([102], "length")]
        assert got[1] == [([200], ""), ([201], "stop")]
        assert bus.malformed == 0
    finally:
        push.close(0)
        ctx.term()
        await bus.close()


def test_gateway_bus_dispatches_each_delta_of_a_batch_to_its_stream():
    asyncio.run(_bus_receives_batched_deltas())
