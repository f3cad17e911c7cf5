"""The streamed answers of ``POST /v1/audio/speech``: how audio chunks, as ``speech.speak`` yields
them, reach the client once its request asked for ``stream_format``.

* ``"audio"`` (:func:`speech_body_stream`): the file as a chunked HTTP body, each chunk written as
  the worker synthesises it;
* ``"sse"`` (:func:`speech_event_stream`): OpenAI's events, ``{"type": "speech.audio.delta",
  "audio": <base64>}`` per chunk, then ``{"type": "speech.audio.done", "usage": …}``.

Both wait for the first chunk before the status goes out, so a failure before it is still a JSON
error with its status code (raised to the route); a failure after it is returned to the route (for
its metrics and log), having broken the body (``audio``) or been sent as the last event (``sse``).

Both streams concatenate to the file: ``pcm`` is raw PCM from the first byte, ``wav`` starts with a
header of unknown length (0xFFFFFFFF: ``speech.py``). FLAC is accepted by both, synthesised whole:
its bytes arrive together once the utterance is done (the FLAC header wants the length; a client
that always asks for a stream still gets every format this server has). Usage of the ``sse``
stream: ``input_tokens`` the prompt's tokens (template + text, what prefill computed),
``output_tokens`` the talker's codec tokens (:class:`SpokenAudio`: recovered from the audio's
length — the worker reports its count to the broker only).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from typing import AsyncIterator

from aiohttp import web

from omnirelay.errors import OmniError

from ..app_keys import CONFIG
from ..error_answers import error_event
from ..speech_facts import CODES_PER_SECOND

log = logging.getLogger("omnirelay.gateway")

SAMPLE_RATE = 24000   # token2wav turns each of Qwen2.5-Omni's codes (CODES_PER_SECOND) into 480 samples
WAV_HEADER_BYTES = 44   # the one-shot's and the streamed header (workers/speech/role.py) alike


async def speech_body_stream(request: web.Request, items: AsyncIterator, mime: str,
                             request_id: str) -> tuple[web.StreamResponse, OmniError | None]:
    """``stream_format: "audio"``: the file as a chunked body, each chunk written as the worker
    synthesises it. A failure before the first chunk raises (its status code still goes out); after
    it, the connection is closed before the body's terminating chunk, so the client sees an
    incomplete body rather than a short file that looks whole, and the error is returned."""
    config = request.app[CONFIG]
    first = await anext(items, None)
    response = web.StreamResponse(headers={"Content-Type": mime, "X-Request-Id": request_id})
    response.enable_chunked_encoding()
    await response.prepare(request)
    item = first
    try:
        while item is not None:
            try:
                await asyncio.wait_for(response.write(base64.b64decode(item.data)), config.stream_write_timeout_s)
            except asyncio.TimeoutError:
                raise ConnectionResetError(f"client did not read for {config.stream_write_timeout_s:.0f}s") from None
            item = await anext(items, None)
    except OmniError as exc:
        log.warning("request %s: speech stream broken after its status went out: %s", request_id, exc)
        if request.transport is not None:
            request.transport.close()
        return response, exc
    return response, None


class SpokenAudio:
    """How many codec tokens the talker spoke, from the audio a stream carried (``usage.output_tokens``).

    The worker counts its codes but tells only the broker (its stats); what reaches the gateway is
    the audio, and token2wav makes exactly ``SAMPLE_RATE / CODES_PER_SECOND`` samples per code, so
    the samples give the count back (the codes spoken; the talker's end-of-speech code makes no
    audio and is not counted). Exact at speed 1 and for FLAC (whole, so resampled once); a streamed
    resampled answer rounds each piece's length by up to half a sample, which a long one at high
    speed can add up to a code or two."""

    def __init__(self, fmt: str, speed: float, codes_per_second: float = CODES_PER_SECOND):
        self.fmt, self.speed = fmt, speed
        self.codes_per_second = codes_per_second   # Qwen3-TTS: 12.5 frames a second (gateway/routes/speech.py)
        self.audio_bytes = 0
        self.flac_samples = 0

    def add(self, data: str) -> None:
        """One chunk as the worker sent it (base64), counted without decoding it."""
        if self.fmt == "flac" and not self.audio_bytes:
            # FLAC's STREAMINFO, the first metadata block, holds the total sample count (36 bits).
            head = base64.b64decode(data[:36])
            self.flac_samples = int.from_bytes(head[18:26], "big") & ((1 << 36) - 1)
        self.audio_bytes += len(data) // 4 * 3 - data[-2:].count("=")

    @property
    def codes(self) -> int:
        if self.fmt == "flac":
            samples = self.flac_samples
        else:
            samples = max(0, self.audio_bytes - (WAV_HEADER_BYTES if self.fmt == "wav" else 0)) // 2
        return round(samples * self.speed * self.codes_per_second / SAMPLE_RATE)


async def speech_event_stream(request: web.Request, items: AsyncIterator, spoken: SpokenAudio,
                              input_tokens: int, request_id: str) -> tuple[web.StreamResponse, OmniError | None]:
    """``stream_format: "sse"``: a ``speech.audio.delta`` event per chunk as the worker synthesises
    it (its base64 copied through), then ``speech.audio.done`` with the usage. A failure before the
    first chunk raises (its status still goes out); after it, the error is the last event, and returned."""
    config = request.app[CONFIG]
    first = await anext(items, None)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": request_id})
    await response.prepare(request)

    async def send(event: dict) -> None:
        try:
            async with asyncio.timeout(config.stream_write_timeout_s):
                await response.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
        except TimeoutError:
            # The client stopped reading: give the worker back rather than wait.
            raise ConnectionResetError(f"client did not read for {config.stream_write_timeout_s:.0f}s") from None

    error, item = None, first
    try:
        while item is not None:
            spoken.add(item.data)
            await send({"type": "speech.audio.delta", "audio": item.data})
            item = await anext(items, None)
        usage = {"input_tokens": input_tokens, "output_tokens": spoken.codes,
                 "total_tokens": input_tokens + spoken.codes}
        await send({"type": "speech.audio.done", "usage": usage})
    except OmniError as exc:
        # Headers are gone: the error travels as the last event, in the body every error has.
        log.warning("request %s: speech events broken after their status went out: %s", request_id, exc)
        exc.request_id = exc.request_id or request_id
        error = exc
        await send(error_event(exc))
    await response.write_eof()
    return response, error
