"""Transcripts of a Realtime session's committed audio (``session.audio.input.transcription``), made
by a served model that hears, through the same path as ``POST /v1/audio/transcriptions`` (the clip and
an instruction as one chat message: encode → prefill → decode, greedy).

Life of a turn's transcript::

    input_audio_buffer committed (by the client or by server VAD) ──▶ Transcriber.submit(item id, clip)
        ──▶ the session's one transcription task takes the clips in commit order
        ──▶ conversation.item.input_audio_transcription.delta {item_id, content_index, delta} per text piece
        ──▶ conversation.item.input_audio_transcription.completed {item_id, content_index, transcript, usage}
            or .failed {item_id, content_index, error} (the clip too long for the model, a worker lost)

The transcript runs beside the turn's response, not before it: the response hears the audio itself.
A transcript is at most MAX_TRANSCRIPT_TOKENS tokens (Whisper's bound for its 30 s window; the
model's own clip bound is 30 s too). The session owns the :class:`Transcriber`: ``close`` cancels
its task, which cancels its request upstream, and joins it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from typing import Any

from aiohttp import web

from omnirelay.errors import BadRequest, OmniError, Unprocessable

from .. import generation
from ..app_keys import BUS, CONFIG, MODELS
from ..cpu_work import off_loop
from ..models import ModelRuntime
from ..schema import parse_chat
from ..websocket_session import EventSocket, join, unexpected
from .realtime_fields import refuse_others
from .transcriptions import _instruction as instruction

MAX_TRANSCRIPT_TOKENS = 448
MAX_PROMPT_CHARS = 4096
MAX_QUEUED = 64                 # committed clips waiting for their transcript; more: a failed event each
_LANGUAGE = re.compile(r"^[a-z]{2}$")


@dataclasses.dataclass(frozen=True)
class Transcription:
    """``audio.input.transcription``: which served model transcribes, with an optional language hint
    and prompt (context, as the HTTP route takes them)."""

    model: str
    language: str | None = None
    prompt: str = ""

    def to_json(self) -> dict:
        return {"model": self.model, "language": self.language, "prompt": self.prompt}

    @classmethod
    def parse(cls, raw: Any, models: dict, session_model: str, param: str) -> "Transcription | None":
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise BadRequest(f"'{param}' must be an object or null", param=param)
        name = raw.get("model") or session_model
        model = models.get(name)
        if not isinstance(model, ModelRuntime) or model.media is None:
            raise Unprocessable(f"{param}.model {name!r} is not a served model that hears; transcripts are made by "
                                "one (see GET /v1/models), e.g. the session's own", param=f"{param}.model")
        language = raw.get("language")
        if language is not None and not (isinstance(language, str) and _LANGUAGE.match(language)):
            raise BadRequest(f"'{param}.language' must be an ISO-639-1 code such as 'en'", param=f"{param}.language")
        prompt = raw.get("prompt") or ""
        if not isinstance(prompt, str) or len(prompt) > MAX_PROMPT_CHARS:
            raise BadRequest(f"'{param}.prompt' must be a string of at most {MAX_PROMPT_CHARS} characters",
                             param=f"{param}.prompt")
        refuse_others(raw, {"model", "language", "prompt"}, param)
        return cls(model=name, language=language, prompt=prompt)


class Transcriber:
    """One session's transcripts, one at a time in commit order, on a task it owns."""

    def __init__(self, app: web.Application, socket: EventSocket, session_id: str):
        self.app, self.socket, self.session_id = app, socket, session_id
        self.queue: asyncio.Queue[tuple[str, str, Transcription]] = asyncio.Queue(MAX_QUEUED)
        self.task: asyncio.Task | None = None
        self.working = False

    def busy(self) -> bool:
        return self.working or not self.queue.empty()

    async def submit(self, item_id: str, clip: str, settings: Transcription) -> None:
        """Queue the committed WAV clip (base64) of ``item_id``; its events follow on the socket."""
        try:
            self.queue.put_nowait((item_id, clip, settings))
        except asyncio.QueueFull:
            await self._failed(item_id, Unprocessable(f"{MAX_QUEUED} transcripts are already waiting"))
            return
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run(), name=f"{self.session_id}-transcripts")

    async def close(self) -> None:
        await join(self.task)

    async def _run(self) -> None:
        while True:
            item_id, clip, settings = await self.queue.get()
            self.working = True
            try:
                await self._transcribe(item_id, clip, settings)
            except OmniError as exc:
                await self._failed(item_id, exc)
            except Exception as exc:   # a bug: logged, and the item still gets its failed event
                await self._failed(item_id, unexpected(exc, f"realtime session {self.session_id}: transcript"))
            finally:
                self.working = False

    async def _transcribe(self, item_id: str, clip: str, settings: Transcription) -> None:
        model = self.app[MODELS].get(settings.model)
        if not isinstance(model, ModelRuntime):   # the model went away since the session chose it
            raise Unprocessable(f"model {settings.model!r} is no longer served")
        body = {"model": model.name, "temperature": 0.0, "max_tokens": MAX_TRANSCRIPT_TOKENS, "messages": [
            {"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}},
                {"type": "text", "text": instruction("transcribe", settings.language, settings.prompt or None)}]}]}
        gen = await off_loop(self.app, generation.prepare, model, parse_chat(body), "trsc")
        chunks = generation.run(self.app[BUS], gen, time.time() + self.app[CONFIG].request_timeout_s)
        where = {"item_id": item_id, "content_index": 0}
        text = []
        try:
            async for chunk in chunks:
                if chunk.text:
                    text.append(chunk.text)
                    await self.socket.send({"type": "conversation.item.input_audio_transcription.delta", **where,
                                            "delta": chunk.text})
        finally:
            await chunks.aclose()   # an early exit cancels the request upstream
        await self.socket.send({
            "type": "conversation.item.input_audio_transcription.completed", **where,
            "transcript": "".join(text).strip(),
            "usage": {"type": "tokens", "input_tokens": gen.prompt_tokens, "output_tokens": gen.completion_tokens,
                      "total_tokens": gen.prompt_tokens + gen.completion_tokens}})

    async def _failed(self, item_id: str, error: OmniError) -> None:
        await self.socket.send({"type": "conversation.item.input_audio_transcription.failed", "item_id": item_id,
                                "content_index": 0, "error": {"type": error.error_type, "code": error.error_type,
                                                              "message": error.message, "param": error.param}})
