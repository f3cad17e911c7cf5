"""One token message per gateway per decode step: DecodeRole batches a step's deltas by ``reply_to``
into a ``TokenDeltas``, and the gateway's bus hands each delta to its stream as if it came alone.

The role is driven by a stand-in engine (the batching is about messages, not about the model); the
bus test pushes real frames over ZeroMQ into a real :class:`BusClient`.
"""

from __future__ import annotations

import asyncio
import time

import zmq

from omnirelay.broker import protocol as p
from omnirelay.gateway.bus import BusClient, RequestStream
from omnirelay.workers.decode import StepOutput, TokenOut
from omnirelay.workers.roles import BROKER, DecodeRole

GW_A, GW_B = "tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"


class ScriptedEngine:
    """Returns the given step outputs, one per ``step()``."""

    connector = None

    def __init__(self, *steps: StepOutput):
        self._steps = list(steps)

    def step(self) -> StepOutput:
        return self._steps.pop(0)


def test_a_step_sends_one_message_per_gateway_then_its_reports():
    speech_outputs = {"speech_key": "k"}
    step = StepOutput(
        tokens=[TokenOut("a1", GW_A, 5, 11, ""), TokenOut("b1", GW_B, 9, 21, ""),
                TokenOut("a2", GW_A, 7, 12, "stop"), TokenOut("a3", GW_A, 2, 13, "length", speech_outputs)],
        failed=[("a4", GW_A, "deadline_exceeded", "deadline passed in decode")])
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
    assert (type(done_a2), done_a2.request_id, done_a2.finished, done_a2.outputs) == (p.StageDone, "a2", True, {})
    assert (done_a3.request_id, done_a3.finished, done_a3.outputs) == ("a3", False, speech_outputs)
    assert (type(failed), failed.request_id, failed.error_type) == (p.StageFailed, "a4", "deadline_exceeded")
    for _, msg in out:   # everything the role produces survives the wire
        assert p.decode(p.encode(msg)) == msg


def test_a_step_without_tokens_sends_no_token_message():
    role = DecodeRole("dec-1", ScriptedEngine(StepOutput()))
    assert role.step() == []


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
            submit = p.Submit(rid, "m", ["decode"], [1], {}, deadline, bus.reply_to)
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
