"""A Submit the broker cannot read fails its request at once (never a wait for the deadline).

The broker answers a malformed message with an ErrorReply; for a Submit whose body decodes far enough
to name its request, the reply carries that ``request_id``, and the gateway's bus fails the request
with a 400 naming the field. The gateway's own builders never send such a Submit (every params
struct runs its checks where it is built); a gateway of another release or a bug would, and its
client used to wait the whole request deadline. A real broker daemon and a real BusClient here.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from omnirelay.broker import protocol as p
from omnirelay.errors import BadRequest
from omnirelay.gateway.bus import BusClient
from omnirelay.request_params import TextParams


def test_the_refusal_names_the_request_only_when_the_body_says_it():
    bad_stages = p.encode(p.Submit("r-7", "m", [1], [1], TextParams(), 1.0, ""))   # stages must be strings
    assert p.submitted_request_id(bad_stages) == "r-7"
    with pytest.raises(p.ProtocolError, match=r"Submit.stages\[0\]"):
        p.decode(bad_stages)
    for frames in ([p.VERSION_FRAME, p.Submit.TAG, b"\xc1"], [p.VERSION_FRAME, p.Submit.TAG, b"\x81\xaarequest_id\x07"],
                   p.encode(p.Cancel("r-7")), [b"x"]):
        assert p.submitted_request_id(frames) == ""


@pytest.mark.timeout(120)
def test_a_submit_the_broker_cannot_read_fails_at_once_naming_the_field(tmp_path):
    endpoint = f"ipc://{tmp_path}/broker.sock"
    with open(tmp_path / "broker.log", "w") as log:
        broker = subprocess.Popen([sys.executable, "-m", "omnirelay.broker.daemon", "--endpoint", endpoint],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    async def scenario() -> None:
        bus = BusClient(endpoint)
        await bus.start()
        try:
            far = time.time() + 600   # what the client would have waited for without the request id
            stream = await bus.submit(p.Submit("r-bad", "m", [1], [1], TextParams(), far, bus.reply_to))
            with pytest.raises(BadRequest, match=r"Submit.stages\[0\]") as refused:
                async with asyncio.timeout(60):
                    async for _ in stream.events():
                        pass
            assert refused.value.request_id == "r-bad"
        finally:
            await bus.close()

    try:
        asyncio.run(scenario())
    finally:
        broker.terminate()
        assert broker.wait(30) == 0
