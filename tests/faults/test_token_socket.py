"""The gateway's token socket against a hostile peer (issue #27, item 8), on a real BusClient and real
ZeroMQ sockets in this process: a frame larger than one bus message is refused by libzmq before it is
received (the peer is disconnected: nothing allocated, nothing counted), and a flood of junk messages is
counted and dropped with one log line, not one per message.

Before the bound, each 20 MiB frame was received whole (3 of 200 MiB cost the gateway +595 MB) and
counted as malformed; every junk message logged a line (2,000 lines for 2,000 messages).
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from cluster import free_tcp_endpoint
from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams
from omnirelay.gateway.bus import BusClient


async def _sentinel(bus: BusClient, push: zmq.asyncio.Socket, name: str) -> None:
    """Send a real token delta for a request opened on ``bus`` and wait until it is delivered: what the
    same PUSH connection sent before it has then been read (or refused) by the bus, in order."""
    submit = p.Submit(request_id=name, model="m", stages=["decode"], prompt_token_ids=[1], params=TextParams(),
                      deadline=time.time() + 60, reply_to=bus.reply_to)
    stream = await bus.submit(submit)   # queued toward a broker that is not there: only the stream matters
    await push.send_multipart(p.encode(p.TokenDelta(request_id=name, start=0, token_ids=[7], finish_reason="stop")))
    async with asyncio.timeout(60):
        event = await anext(stream.events())
    assert event.tokens == [7]


def test_oversized_frames_are_refused_and_junk_is_logged_once(caplog):
    async def scenario() -> tuple[int, int, int]:
        bus = BusClient(free_tcp_endpoint())   # no broker: the token socket is what is tested
        await bus.start()
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        try:
            push.connect(bus.reply_to)
            for _ in range(3):
                await push.send(b"\x00" * (20 * 1024 * 1024))
            await push.send(b"marker: not a bus message")
            await _sentinel(bus, push, "after-the-big-frames")
            after_big = bus.malformed   # the marker alone: the big frames never arrived
            for i in range(2000):
                await push.send(b"junk %d" % i)
            await _sentinel(bus, push, "after-the-junk")
            return after_big, bus.malformed, sum("malformed message" in r.getMessage() for r in caplog.records)
        finally:
            push.close()
            ctx.term()
            await bus.close()

    with caplog.at_level(logging.WARNING, logger="omnirelay.gateway"):
        after_big, total, lines = asyncio.run(scenario())
    assert after_big == 1, f"{after_big - 1} oversized frames were received whole"
    assert total == 2001
    assert lines <= 2, f"{lines} log lines for 2001 junk messages"
