"""``POST /v1/audio/speech`` with ``stream_format: "sse"`` without a cluster: the event framing of
``gateway/routes/speech_responses.py``'s ``speech_event_stream`` over a real aiohttp server fed a scripted chunk stream
(a failure before the first chunk is a JSON error with its status; after it, one last error event
in the error contract's body), and :class:`SpokenAudio`, the codec-token count of ``usage``.
The end-to-end path (official client, real workers) is in test_omni_speech.py."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from omnirelay.errors import OmniError, WorkerLost
from omnirelay.gateway.app_keys import CONFIG
from omnirelay.gateway.config import GatewayConfig, ServedModel
from omnirelay.gateway.middleware import errors
from omnirelay.gateway.routes.speech import AudioChunk
from omnirelay.gateway.routes.speech_responses import SpokenAudio, speech_event_stream

SAMPLES_PER_CODE = 480


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


async def _post(tmp_path, chunks: list[bytes], failure: OmniError | None) -> tuple[int, str, str, list]:
    """Serve one request whose upstream yields ``chunks`` then raises ``failure``; returns the
    status, content type, body and what ``speech_event_stream`` returned (its error) or raised."""
    returned: list = []

    async def items():
        for chunk in chunks:
            yield AudioChunk(_b64(chunk))
        if failure is not None:
            raise failure

    async def handler(request: web.Request) -> web.StreamResponse:
        response, error = await speech_event_stream(request, items(), SpokenAudio("pcm", 1.0), 9, "speech-test")
        returned.append(error)
        return response

    app = web.Application(middlewares=[errors])
    app[CONFIG] = GatewayConfig(models=(ServedModel("m", str(tmp_path)),))
    app.router.add_post("/speech", handler)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        async with session.post(server.make_url("/speech"), timeout=aiohttp.ClientTimeout(total=30)) as r:
            return r.status, r.headers["Content-Type"], await r.text(), returned


def _events(body: str) -> list[dict]:
    assert body.endswith("\n\n")
    return [json.loads(block.removeprefix("data: ")) for block in body.strip().split("\n\n")]


def test_deltas_then_done_with_usage(tmp_path):
    pcm = [b"\x01\x00" * SAMPLES_PER_CODE * 3, b"\x02\x00" * SAMPLES_PER_CODE]
    status, ctype, body, returned = asyncio.run(_post(tmp_path, pcm, None))
    assert (status, ctype, returned) == (200, "text/event-stream", [None])
    events = _events(body)
    assert [e["type"] for e in events] == ["speech.audio.delta"] * 2 + ["speech.audio.done"]
    assert [base64.b64decode(e["audio"]) for e in events[:2]] == pcm
    assert events[-1]["usage"] == {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13}


def test_a_failure_after_the_first_event_is_the_last_event(tmp_path):
    lost = WorkerLost("generate worker gone", stage="generate")
    status, _, body, returned = asyncio.run(_post(tmp_path, [b"\x00\x00" * 10], lost))
    assert status == 200 and returned == [lost]
    delta, error = _events(body)
    assert delta["type"] == "speech.audio.delta"
    assert error == {"type": "error", "error": {"message": "generate worker gone", "type": "server_error",
                                                 "param": None, "code": "worker_lost"},
                     "request_id": "speech-test", "stage": "generate"}


def test_a_failure_before_the_first_event_keeps_its_status(tmp_path):
    lost = WorkerLost("generate worker gone", request_id="speech-test", stage="generate")
    status, ctype, body, returned = asyncio.run(_post(tmp_path, [], lost))
    assert (status, ctype.split(";")[0], returned) == (503, "application/json", [])
    assert json.loads(body)["error"]["code"] == "worker_lost"


def _wav(samples: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(24000)
        out.writeframes(b"\x00\x00" * samples)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["wav", "pcm"])
def test_spoken_audio_counts_codes_from_samples_in_any_chunking(fmt):
    data = _wav(72 * SAMPLES_PER_CODE) if fmt == "wav" else b"\x00\x00" * 72 * SAMPLES_PER_CODE
    for size in (len(data), 1000, 4097, 1):   # padded and unpadded base64 alike
        spoken = SpokenAudio(fmt, 1.0)
        for i in range(0, len(data), size):
            spoken.add(_b64(data[i:i + size]))
        assert spoken.codes == 72


def test_spoken_audio_undoes_the_speed_change():
    spoken = SpokenAudio("pcm", 2.0)   # twice as fast: half the samples per code
    spoken.add(_b64(b"\x00\x00" * (40 * SAMPLES_PER_CODE // 2)))
    assert spoken.codes == 40


def test_spoken_audio_reads_flac_length_from_its_header():
    soundfile = pytest.importorskip("soundfile")
    buf = io.BytesIO()
    noise = (np.random.default_rng(0).standard_normal(33 * SAMPLES_PER_CODE) * 1000).astype("<i2")
    soundfile.write(buf, noise, 24000, format="FLAC", subtype="PCM_16")
    data = buf.getvalue()
    spoken = SpokenAudio("flac", 1.0)
    for i in range(0, len(data), 12000):
        spoken.add(_b64(data[i:i + 12000]))
    assert spoken.codes == 33
