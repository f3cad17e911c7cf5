"""``/v1/audio/speech/stream``: text in as it is typed (or as an LLM streams it), speech out as it is
synthesised, over one WebSocket.

Life of a session (JSON text frames both ways)::

    connect ──▶ session.created {session}
    session.update {session: {model, voice, response_format: "pcm"|"wav", speed, seed}}
        ──▶ session.updated, or an error event naming the field (``model`` and ``voice`` are needed
            before any text)
    input_text.append {text} ... ──▶ the text is cut at sentence ends (. ! ? and their CJK forms,
        or a line break); each complete sentence becomes an item queued for synthesis
    input_text.flush ──▶ what is left becomes an item too (the end of a turn that has no final stop)
    input_text.end ──▶ flush, then the session ends once every item has been spoken
    per item, in order: speech.audio.delta {item_id, audio: base64} per chunk of incremental
        synthesis (the same path as ``POST /v1/audio/speech`` with ``stream_format``), then
        speech.audio.done {item_id, text, usage {input_tokens}}

``pcm`` deltas of all items, concatenated, are one 16-bit 24 kHz mono stream; with ``wav`` each item's
deltas concatenated are one WAV file (its header says "unknown length"). One item is synthesised at
a time, in order; the next starts when the previous one is done. The queue is bounded
(:data:`MAX_PENDING_CHARS` of text not yet spoken): an append beyond it is refused with an error
event, so a fast writer cannot pile up unbounded work. A client that disconnects cancels the item
being spoken upstream and drops the rest; one that stops reading is disconnected after
``stream_write_timeout_s``; a session idle for ``websocket_idle_timeout_s`` with nothing queued is
closed. An item that fails (a bad voice for the model, a worker lost for good) gets an error event
naming its ``item_id`` and the session goes on with the next.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
import uuid
from typing import Any

from aiohttp import web

from omnirelay.errors import BadRequest, OmniError

from ..app_keys import BUS, CONFIG
from ..error_answers import error_event
from .speech import prepare, speech_items
from ..websocket_session import EventSocket, SessionClosed, event_socket, install, join

log = logging.getLogger("omnirelay.gateway")

ROUTE = "speech_stream"
MAX_PENDING_CHARS = 16384
MAX_APPEND_CHARS = 4096
FORMATS = ("pcm", "wav")
# A sentence ends at ., ! or ? followed by white space, at their full-width forms, or at a line break.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[。！？])|\n+")


def split_sentences(text: str) -> tuple[list[str], str]:
    """The complete sentences at the start of ``text`` and the rest (an unfinished sentence)."""
    sentences, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        sentence = text[start:match.start()].strip()
        if sentence:
            sentences.append(sentence)
        start = match.end()
    return sentences, text[start:]


@dataclasses.dataclass
class Item:
    id: str
    text: str


class SpeechStreamSession:
    """One connection: its settings, the text not yet cut, and the queue of items. The session owns
    the speaker task, which it cancels and joins when it ends."""

    def __init__(self, socket: EventSocket):
        self.socket = socket
        self.app = socket.request.app
        self.id = f"sess_{uuid.uuid4().hex[:20]}"
        self.settings: dict[str, Any] = {"response_format": "pcm"}
        self.pending = ""
        self.queue: asyncio.Queue[Item | None] = asyncio.Queue()
        self.queued_chars = 0
        self.ending = False
        self.speaker: asyncio.Task | None = None

    async def run(self) -> None:
        await self.socket.send({"type": "session.created", "session": self._session_json()})
        self.speaker = asyncio.get_running_loop().create_task(self._speak_items(), name=f"{self.id}-speaker")
        handlers = {"session.update": self._session_update, "input_text.append": self._append,
                    "input_text.flush": self._flush, "input_text.end": self._end}
        try:
            if await self.socket.serve(handlers, busy=lambda: self.queued_chars > 0, until=lambda: self.ending):
                await self.queue.put(None)           # input_text.end: speak what is queued, then stop
                await asyncio.shield(self.speaker)
        except SessionClosed:
            return
        finally:
            await join(self.speaker)

    def _session_json(self) -> dict:
        return {"id": self.id, "object": "speech.session", **self.settings}

    async def _session_update(self, event: dict) -> None:
        raw = event.get("session")
        if not isinstance(raw, dict):
            raise BadRequest("'session' must be an object", param="session")
        unknown = raw.keys() - {"model", "voice", "response_format", "speed", "seed", "type"}
        if unknown:
            raise BadRequest(f"unknown session fields {sorted(unknown)}", param=f"session.{sorted(unknown)[0]}")
        settings = {**self.settings, **{k: v for k, v in raw.items() if k != "type"}}
        if settings.get("response_format") not in FORMATS:
            raise BadRequest("'session.response_format' must be 'pcm' or 'wav'", param="session.response_format")
        if "model" in settings and "voice" in settings:   # checked as a request would be, with a probe text
            try:
                await prepare(self.app, {**settings, "input": "."}, streamed=True)
            except OmniError as exc:
                exc.param = f"session.{exc.param}" if exc.param else "session"
                raise
        self.settings = settings
        await self.socket.send({"type": "session.updated", "session": self._session_json()})

    async def _append(self, event: dict) -> None:
        text = event.get("text")
        if not isinstance(text, str) or len(text) > MAX_APPEND_CHARS:
            raise BadRequest(f"'text' must be a string of at most {MAX_APPEND_CHARS} characters", param="text")
        if "model" not in self.settings or "voice" not in self.settings:
            raise BadRequest("set session.model and session.voice with session.update first", param="session")
        if self.queued_chars + len(self.pending) + len(text) > MAX_PENDING_CHARS:
            raise BadRequest(f"more than {MAX_PENDING_CHARS} characters wait to be spoken; wait for "
                             "speech.audio.done events before appending more", param="text")
        sentences, self.pending = split_sentences(self.pending + text)
        for sentence in sentences:
            await self._enqueue(sentence)

    async def _flush(self, event: dict | None = None) -> None:
        rest, self.pending = self.pending.strip(), ""
        if rest:
            await self._enqueue(rest)

    async def _end(self, event: dict) -> None:
        await self._flush()
        self.ending = True

    async def _enqueue(self, text: str) -> None:
        self.queued_chars += len(text)
        await self.queue.put(Item(f"item_{uuid.uuid4().hex[:20]}", text))

    async def _speak_items(self) -> None:
        """The speaker: one item at a time, in order, until the end marker."""
        while (item := await self.queue.get()) is not None:
            try:
                await self._speak(item)
            except OmniError as exc:
                exc.request_id = exc.request_id or item.id
                await self.socket.send(error_event(exc, item_id=item.id))
            except SessionClosed:
                raise
            except Exception as exc:   # a bug: reported, and the items after it are still spoken
                log.exception("speech stream %s: item %s crashed", self.id, item.id)
                error = OmniError(f"internal error: {type(exc).__name__}", request_id=item.id)
                await self.socket.send(error_event(error, item_id=item.id))
            finally:
                self.queued_chars -= len(item.text)

    async def _speak(self, item: Item) -> None:
        job = await prepare(self.app, {**self.settings, "input": item.text}, streamed=True)
        items = speech_items(self.app[BUS], job, time.time() + self.app[CONFIG].request_timeout_s)
        try:
            async for chunk in items:
                await self.socket.send({"type": "speech.audio.delta", "item_id": item.id, "audio": chunk.data})
        finally:
            await items.aclose()   # an early exit (the client gone) cancels the request upstream
        await self.socket.send({"type": "speech.audio.done", "item_id": item.id, "text": item.text,
                                "usage": {"input_tokens": len(job.prompt_token_ids)}})


async def speech_stream(request: web.Request) -> web.StreamResponse:
    async with event_socket(request, ROUTE) as socket:
        await SpeechStreamSession(socket).run()
    return socket.ws


def add_speech_stream_routes(app: web.Application) -> None:
    install(app)
    app.router.add_get("/v1/audio/speech/stream", speech_stream)
