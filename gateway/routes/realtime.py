"""``/v1/realtime``: OpenAI's Realtime API over a WebSocket, turn by turn — audio (or text) in, spoken
(or written) answers out, on the same stages as a chat completion.

Life of a session (a subset of the Realtime GA protocol; every event is a JSON text frame)::

    connect (``?model=NAME`` optional) ──▶ session.created {session}
    session.update {session: {model, output_modalities, instructions, max_output_tokens,
                              audio: {input: {format: {type: "audio/pcm", rate}, turn_detection},
                                      output: {voice, speed}}}}
        ──▶ session.updated (the whole session as it now is) or an error event naming the field
            (noise_reduction, tools and any other field not served are refused by name)
    input_audio_buffer.append {audio: base64 PCM16 mono at the input rate} ... (bounded: 15 MiB)
        with turn_detection server_vad (the default; null turns it off), each append is read by
        Silero VAD (gateway/vad.py, on the CPU pool, one feed per session at a time):
        ──▶ input_audio_buffer.speech_started {audio_start_ms, item_id} (a response of the
            conversation still running is cancelled: response.done cancelled, reason turn_detected)
        ──▶ input_audio_buffer.speech_stopped {audio_end_ms, item_id} ──▶ the turn is committed as
            below, and (create_response) a response starts as if response.create had come
    input_audio_buffer.commit ──▶ the buffer becomes a user item (a WAV clip of the conversation)
        ──▶ input_audio_buffer.committed, conversation.item.added, conversation.item.done
        ──▶ with audio.input.transcription, its transcript's events follow (realtime_transcription.py)
    input_audio_buffer.clear ──▶ input_audio_buffer.cleared
    conversation.item.create {item: {type: "message", role, content: [input_text | input_audio]}}
        ──▶ conversation.item.added, conversation.item.done (an item's text is bounded: MAX_ITEM_TEXT_CHARS)
    response.create {response: {output_modalities?, instructions?, max_output_tokens?,
                                audio?: {output: {voice}}, conversation?: "auto" | "none", metadata?}}
        ──▶ response.created ──▶ response.output_item.added
        ──▶ audio: the conversation as a chat request with ``modalities: ["text", "audio"]``
            (encode → prefill → decode → generate): response.output_audio_transcript.delta as the
            reply's text arrives, response.output_audio.delta (base64 PCM16, 24 kHz mono) per chunk
            of incremental synthesis, then response.output_audio.done and
            response.output_audio_transcript.done
        ──▶ text: the same without generate: response.output_text.delta, response.output_text.done
        ──▶ response.output_item.done ──▶ response.done {response: {status, usage}}; the reply joins
            the conversation as an assistant item (not with conversation "none": out of band)
    response.cancel ──▶ the response's request is cancelled on every stage ──▶ response.done
        {status: "cancelled"}

The conversation is bounded: at most MAX_ITEMS items and MAX_CONVERSATION_BYTES of text and audio (the
oldest items go first), so a session cannot grow the gateway's memory, or one response's tokenization,
without limit. One response runs at a time (a second ``response.create`` is an error event). A client that
disconnects mid-answer cancels the request upstream (its KV is freed on every stage); a client that
stops reading is disconnected after ``stream_write_timeout_s`` (:mod:`.websocket_session`). Errors
of one event are error events; the session goes on. The response's failures (a worker lost for
good, the deadline) end it with ``response.done`` status ``failed`` and an error event; so does an
unexpected exception (a bug), which is logged too — a response never ends silently.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import io
import time
import uuid
import wave
from typing import Any

from aiohttp import web

from omnirelay.errors import BadRequest, NotFound, OmniError, Unprocessable

from .. import generation
from ..app_keys import BUS, CONFIG, MODELS
from ..cpu_work import off_loop
from ..detokenizer import IncrementalDetokenizer
from ..models import ModelRuntime
from ..schema import parse_chat
from .speech import AudioChunk, has_speakers, start_spoken_chat, voices
from .realtime_fields import OUTPUT_RATE, metadata as _metadata, output_format as _output_format, \
    object_field as _object, refuse_others as _refuse_others, speed as _speed, tools as _tools, voice as _voice
from .realtime_transcription import Transcriber, Transcription
from ..vad import SpeechDetector, SpeechStarted, TurnDetection, load_model
from ..websocket_session import EventSocket, SessionClosed, event_socket, install, join, unexpected

ROUTE = "realtime"
MIN_INPUT_RATE, MAX_INPUT_RATE = 8000, 48000
MAX_BUFFER_BYTES = 15 * 1024 * 1024      # OpenAI's bound on one turn's input audio
MAX_ITEMS = 64                           # conversation items kept; the oldest go first
MAX_CONVERSATION_BYTES = 32 * 1024 * 1024   # their text (characters) and audio (base64) kept; the same
MAX_ITEM_TEXT_CHARS = 1024 * 1024        # the text of one created item (more: an error event)
MAX_INSTRUCTIONS_CHARS = 16384
MODALITIES = (("audio",), ("text",))
QUIET_KEEP_S = 30                        # with turn detection on, audio kept while nobody speaks


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclasses.dataclass(frozen=True)
class SessionConfig:
    """What ``session.update`` sets; :meth:`updated` validates a partial update."""

    model: str
    output_modalities: tuple[str, ...] = ("audio",)
    instructions: str = ""
    voice: str | None = None
    input_rate: int = OUTPUT_RATE
    max_output_tokens: int | None = None
    turn_detection: TurnDetection | None = TurnDetection()   # OpenAI's default: server VAD on
    transcription: Transcription | None = None
    speed: float = 1.0

    def to_json(self, session_id: str) -> dict:
        turns = self.turn_detection.to_json() if self.turn_detection is not None else None
        return {"type": "realtime", "object": "realtime.session", "id": session_id, "model": self.model,
                "output_modalities": list(self.output_modalities), "instructions": self.instructions,
                "max_output_tokens": self.max_output_tokens if self.max_output_tokens is not None else "inf",
                "tools": [], "tool_choice": "auto",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": self.input_rate},
                                    "turn_detection": turns, "noise_reduction": None,
                                    "transcription": self.transcription and self.transcription.to_json()},
                          "output": {"format": {"type": "audio/pcm", "rate": OUTPUT_RATE}, "voice": self.voice,
                                     "speed": self.speed}}}

    def updated(self, raw: Any, models: dict) -> "SessionConfig":
        if not isinstance(raw, dict):
            raise BadRequest("'session' must be an object", param="session")
        changes: dict[str, Any] = {}
        if "model" in raw:
            model = _model(models, raw["model"], "session.model")
            changes["model"] = model.name
            if self.voice is not None and self.voice not in (voices(model) or [self.voice]):
                changes["voice"] = None
        if "output_modalities" in raw:
            changes["output_modalities"] = _modalities(raw["output_modalities"], "session.output_modalities")
        if "instructions" in raw:
            changes["instructions"] = _instructions(raw["instructions"], "session.instructions")
        if "max_output_tokens" in raw:
            changes["max_output_tokens"] = _max_tokens(raw["max_output_tokens"], "session.max_output_tokens")
        audio = raw.get("audio")
        if audio is not None:
            if not isinstance(audio, dict):
                raise BadRequest("'session.audio' must be an object", param="session.audio")
            audio_in = _object(audio.get("input"), "session.audio.input")
            if "format" in audio_in:
                changes["input_rate"] = _input_format(audio_in["format"])
            if "turn_detection" in audio_in:
                changes["turn_detection"] = TurnDetection.parse(audio_in["turn_detection"],
                                                                "session.audio.input.turn_detection")
            if "transcription" in audio_in:
                changes["transcription"] = Transcription.parse(audio_in["transcription"], models,
                                                               changes.get("model", self.model),
                                                               "session.audio.input.transcription")
            if audio_in.get("noise_reduction") is not None:   # no denoiser runs here: refused, never ignored
                raise Unprocessable("session.audio.input.noise_reduction is not served by this server; send null",
                                    param="session.audio.input.noise_reduction")
            _refuse_others(audio_in, {"format", "turn_detection", "transcription", "noise_reduction"},
                           "session.audio.input")
            audio_out = _object(audio.get("output"), "session.audio.output")
            if "format" in audio_out:
                _output_format(audio_out["format"], "session.audio.output.format")
            if "voice" in audio_out:
                changes["voice"] = audio_out["voice"]
            if audio_out.get("speed") is not None:
                changes["speed"] = _speed(audio_out["speed"], "session.audio.output.speed")
            _refuse_others(audio_out, {"format", "voice", "speed"}, "session.audio.output")
            _refuse_others(audio, {"input", "output"}, "session.audio")
        _tools(raw, "session")
        _refuse_others(raw, {"type", "model", "output_modalities", "instructions", "max_output_tokens", "audio",
                             "tools", "tool_choice"}, "session")
        config = dataclasses.replace(self, **changes)
        if config.voice is not None:
            config = dataclasses.replace(config, voice=_voice(models[config.model], config.voice,
                                                              "session.audio.output.voice"))
        return config


def _model(models: dict, name: Any, param: str) -> ModelRuntime:
    if not isinstance(name, str) or not name:
        raise BadRequest(f"'{param}' must be a non-empty string", param=param)
    model = models.get(name)
    if not isinstance(model, ModelRuntime):
        raise NotFound(f"model {name!r} does not exist or does not chat; see GET /v1/models", param=param)
    return model


def _modalities(value: Any, param: str) -> tuple[str, ...]:
    if not isinstance(value, list) or tuple(value) not in MODALITIES:
        raise BadRequest(f"'{param}' must be [\"audio\"] or [\"text\"]", param=param)
    return tuple(value)


def _instructions(value: Any, param: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_INSTRUCTIONS_CHARS:
        raise BadRequest(f"'{param}' must be a string of at most {MAX_INSTRUCTIONS_CHARS} characters", param=param)
    return value


def _max_tokens(value: Any, param: str) -> int | None:
    if value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise BadRequest(f"'{param}' must be an integer from 1 to 4096 or \"inf\"", param=param)
    return value


def _input_format(fmt: Any) -> int:
    param = "session.audio.input.format"
    if not isinstance(fmt, dict) or fmt.get("type") != "audio/pcm":
        raise Unprocessable("input audio must be audio/pcm (16-bit little-endian mono)", param=param)
    rate = fmt.get("rate", OUTPUT_RATE)
    if isinstance(rate, bool) or not isinstance(rate, int) or not MIN_INPUT_RATE <= rate <= MAX_INPUT_RATE:
        raise BadRequest(f"'{param}.rate' must be an integer from {MIN_INPUT_RATE} to {MAX_INPUT_RATE}",
                         param=param + ".rate")
    return rate


def _pcm16(data: Any, param: str) -> bytes:
    if not isinstance(data, str):
        raise BadRequest(f"'{param}' must be base64 of 16-bit PCM", param=param)
    try:
        pcm = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"'{param}' is not valid base64", param=param) from None
    if len(pcm) % 2:
        raise BadRequest(f"'{param}' must hold whole 16-bit samples (an even number of bytes)", param=param)
    return pcm


def wav_clip(pcm: bytes, rate: int) -> bytes:
    """PCM16 mono bytes as a WAV file (what a chat ``input_audio`` part carries)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm)
    return out.getvalue()


def _default_model(models: dict) -> str:
    """A model that hears and speaks when one is served, else the first that chats."""
    chatting = [m for m in models.values() if isinstance(m, ModelRuntime)]
    if not chatting:
        raise NotFound("no served model chats; /v1/realtime needs one", param="model")
    speaking = [m for m in chatting if m.media is not None and "generate" in m.stages and has_speakers(m)]
    return (speaking or chatting)[0].name


class RealtimeSession:
    """One connection's conversation, input buffer and (at most one) running response. The session
    owns the response task: it cancels and joins it on ``response.cancel`` and when it ends."""

    def __init__(self, socket: EventSocket, config: SessionConfig):
        self.socket = socket
        self.app = socket.request.app
        self.config = config
        self.id = _new_id("sess")
        self.buffer = bytearray()
        self.items: list[tuple[str, dict]] = []     # (item id, chat message)
        self.response: asyncio.Task | None = None
        self.response_id = ""
        self.response_ended = ""                     # the last response that sent its own response.done
        self.response_meta: dict = {}                # the running response's conversation_id, metadata, ...
        self.conversation_id = _new_id("conv")
        self.transcriber = Transcriber(self.app, socket, self.id)
        self.detector: SpeechDetector | None = None  # server VAD, made at the first append with it on
        self.buffer_offset = 0                       # samples the detector read before buffer[0]
        self.speech_item = ""                        # the item id a detected turn will commit as
        self.speech_start_ms = 0                     # where that turn began, in the detector's time

    async def run(self) -> None:
        await self.socket.send({"type": "session.created", "session": self.config.to_json(self.id)})
        handlers = {"session.update": self._session_update, "input_audio_buffer.append": self._append,
                    "input_audio_buffer.commit": self._commit, "input_audio_buffer.clear": self._clear,
                    "conversation.item.create": self._item_create, "response.create": self._response_create,
                    "response.cancel": self._response_cancel}
        try:
            await self.socket.serve(handlers, busy=lambda: self._responding() or self.transcriber.busy())
        except SessionClosed:
            return
        finally:
            await join(self.response)
            await self.transcriber.close()

    def _responding(self) -> bool:
        return self.response is not None and not self.response.done()

    # ------------------------------------------------------------------ client events

    async def _session_update(self, event: dict) -> None:
        self.config = self.config.updated(event.get("session"), self.app[MODELS])
        turns = self.config.turn_detection
        if self.detector is not None and (turns is None or self.detector.rate != self.config.input_rate):
            self.detector = None         # the next append starts one at the new rate (or none); the buffer stays
        elif self.detector is not None:
            self.detector.reconfigure(turns)
        await self.socket.send({"type": "session.updated", "session": self.config.to_json(self.id)})

    async def _append(self, event: dict) -> None:
        pcm = _pcm16(event.get("audio"), "audio")
        if len(self.buffer) + len(pcm) > MAX_BUFFER_BYTES:
            raise BadRequest(f"the input audio buffer holds at most {MAX_BUFFER_BYTES} bytes; commit or clear it",
                             param="audio")
        self.buffer += pcm
        if self.config.turn_detection is not None:
            await self._detect_turns(pcm)

    async def _detect_turns(self, pcm: bytes) -> None:
        """Server VAD: feed the appended audio to the detector (on the CPU pool; the session awaits it,
        so one session has one feed running at most) and act on each turn event it finds."""
        if self.detector is None:
            model = await off_loop(self.app, load_model)
            self.detector = SpeechDetector(self.config.turn_detection, self.config.input_rate, model)
            self.buffer_offset = -(len(self.buffer) - len(pcm)) // 2   # the detector's time 0 is this append
        for turn in await off_loop(self.app, self.detector.feed, pcm):
            if isinstance(turn, SpeechStarted):
                self.speech_item, self.speech_start_ms = _new_id("item"), turn.audio_start_ms
                await self.socket.send({"type": "input_audio_buffer.speech_started",
                                        "audio_start_ms": turn.audio_start_ms, "item_id": self.speech_item})
                if self.config.turn_detection.interrupt_response and self._responding() \
                        and self.response_meta.get("conversation_id"):
                    await self._cancel_response("turn_detected")
                continue
            await self.socket.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": turn.audio_end_ms,
                                    "item_id": self.speech_item})
            # The turn is the audio from its start (prefix padding included) to the end of its silence.
            rate = self.config.input_rate
            end = min(len(self.buffer) // 2, max(0, turn.audio_end_ms * rate // 1000 - self.buffer_offset))
            start = min(end, max(0, self.speech_start_ms * rate // 1000 - self.buffer_offset))
            await self._commit_audio(bytes(self.buffer[2 * start:2 * end]), self.speech_item)
            del self.buffer[:2 * end]
            self.buffer_offset += end
            if self.config.turn_detection.create_response and not self._responding():
                try:
                    await self._start_response({})
                except OmniError as exc:   # said as the event's error; the turns after it still count
                    await self.socket.send_error(exc)
        if not self.detector.speaking:   # nobody speaks: old quiet audio goes, so listening costs no memory
            drop = max(0, len(self.buffer) // 2 - QUIET_KEEP_S * self.config.input_rate)
            del self.buffer[:2 * drop]
            self.buffer_offset += drop

    def _forget_buffer(self) -> None:
        """The buffer is committed or cleared by the client: the detector's turn (if any) ends with it."""
        self.buffer_offset += len(self.buffer) // 2
        self.buffer.clear()
        if self.detector is not None:
            self.detector.end_turn()

    async def _commit(self, event: dict) -> None:
        min_bytes = 2 * self.config.input_rate // 10   # 100 ms
        if len(self.buffer) < min_bytes:
            raise BadRequest(f"the input audio buffer holds {len(self.buffer) // 2} samples; commit needs at "
                             "least 100 ms of audio", param="input_audio_buffer")
        pcm = bytes(self.buffer)
        self._forget_buffer()
        await self._commit_audio(pcm, _new_id("item"))

    async def _commit_audio(self, pcm: bytes, item_id: str) -> None:
        clip = base64.b64encode(wav_clip(pcm, self.config.input_rate)).decode("ascii")
        previous = self.items[-1][0] if self.items else None
        self._add_item(item_id, {"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}]})
        await self.socket.send({"type": "input_audio_buffer.committed", "previous_item_id": previous,
                                "item_id": item_id})
        await self._announce_item(item_id, "user", [{"type": "input_audio", "transcript": None}])
        if self.config.transcription is not None:
            await self.transcriber.submit(item_id, clip, self.config.transcription)

    async def _clear(self, event: dict) -> None:
        self._forget_buffer()
        await self.socket.send({"type": "input_audio_buffer.cleared"})

    async def _item_create(self, event: dict) -> None:
        item = event.get("item")
        if not isinstance(item, dict) or item.get("type") != "message":
            raise Unprocessable("only items of type 'message' can be created", param="item.type")
        role = item.get("role")
        if role not in ("user", "system", "assistant"):
            raise BadRequest("'item.role' must be user, system or assistant", param="item.role")
        content = item.get("content")
        if not isinstance(content, list) or not content:
            raise BadRequest("'item.content' must be a non-empty list", param="item.content")
        parts, shown, chars = [], [], 0
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "text", "output_text") and isinstance(part.get("text"), str):
                chars += len(part["text"])
                if chars > MAX_ITEM_TEXT_CHARS:
                    raise BadRequest(f"an item's text is at most {MAX_ITEM_TEXT_CHARS} characters",
                                     param=f"item.content[{i}].text")
                parts.append({"type": "text", "text": part["text"]})
                shown.append({"type": kind, "text": part["text"]})
            elif kind == "input_audio" and role == "user":
                pcm = _pcm16(part.get("audio"), f"item.content[{i}].audio")
                clip = base64.b64encode(wav_clip(pcm, self.config.input_rate)).decode("ascii")
                parts.append({"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}})
                shown.append({"type": "input_audio", "transcript": part.get("transcript")})
            else:
                raise BadRequest(f"item.content[{i}]: expected input_text (or input_audio for a user)",
                                 param=f"item.content[{i}]")
        text_only = all(p["type"] == "text" for p in parts)
        message = {"role": role, "content": "".join(p["text"] for p in parts) if text_only else parts}
        item_id = item.get("id") if isinstance(item.get("id"), str) else _new_id("item")
        self._add_item(item_id, message)
        await self._announce_item(item_id, role, shown)

    async def _response_create(self, event: dict) -> None:
        options = event.get("response") or {}
        if not isinstance(options, dict):
            raise BadRequest("'response' must be an object", param="response")
        await self._start_response(options)

    async def _start_response(self, options: dict) -> None:
        """Validate a response's options (a field not served is an error naming it) and start its task."""
        if self._responding():
            raise BadRequest("a response is already in progress; cancel it or wait for response.done",
                             param="response")
        modalities = _modalities(options["output_modalities"], "response.output_modalities") \
            if "output_modalities" in options else self.config.output_modalities
        instructions = _instructions(options["instructions"], "response.instructions") \
            if "instructions" in options else self.config.instructions
        max_tokens = _max_tokens(options["max_output_tokens"], "response.max_output_tokens") \
            if "max_output_tokens" in options else self.config.max_output_tokens
        conversation = options.get("conversation") or "auto"
        if conversation not in ("auto", "none"):
            raise BadRequest("'response.conversation' must be \"auto\" or \"none\" (out of band: the reply "
                             "does not join the conversation)", param="response.conversation")
        metadata = _metadata(options.get("metadata"))
        audio = _object(options.get("audio"), "response.audio")
        audio_out = _object(audio.get("output"), "response.audio.output")
        if "format" in audio_out:
            _output_format(audio_out["format"], "response.audio.output.format")
        voice = self.config.voice
        if audio_out.get("voice") is not None:
            voice = _voice(self.app[MODELS][self.config.model], audio_out["voice"], "response.audio.output.voice")
        _refuse_others(audio_out, {"format", "voice"}, "response.audio.output")
        _refuse_others(audio, {"output"}, "response.audio")
        _tools(options, "response")
        _refuse_others(options, {"output_modalities", "instructions", "max_output_tokens", "audio", "conversation",
                                 "metadata", "tools", "tool_choice"}, "response")
        if not any(message["role"] == "user" for _, message in self.items):
            raise BadRequest("the conversation has no user item to answer; commit audio or create an item",
                             param="response")
        body = self._chat_body(modalities, instructions, max_tokens, voice)
        parsed = parse_chat(body)      # 4xx here, before anything is submitted
        self.response_id = _new_id("resp")
        voice = body.get("audio", {}).get("voice", voice)   # the one that speaks, a default one included
        self.response_meta = {"conversation_id": self.conversation_id if conversation == "auto" else None,
                              "output_modalities": list(modalities), "metadata": metadata,
                              "max_output_tokens": max_tokens if max_tokens is not None else "inf",
                              "audio": {"output": {"format": {"type": "audio/pcm", "rate": OUTPUT_RATE},
                                                   "voice": voice}}}
        self.response = asyncio.get_running_loop().create_task(
            self._respond(self.response_id, modalities, parsed, body), name=self.response_id)

    async def _response_cancel(self, event: dict) -> None:
        if not self._responding():
            raise BadRequest("there is no response in progress", param="response_id")
        await self._cancel_response("client_cancelled")

    async def _cancel_response(self, reason: str) -> None:
        """Cancel the running response upstream (every stage frees its request) and end it with
        ``response.done`` cancelled, unless it finished on its own meanwhile (it said so itself)."""
        await join(self.response)
        if self.response_ended != self.response_id:
            await self.socket.send({"type": "response.done", "response": self._response_json(
                self.response_id, "cancelled", [], {"type": "cancelled", "reason": reason})})

    # ------------------------------------------------------------------ the response

    def _chat_body(self, modalities: tuple[str, ...], instructions: str, max_tokens: int | None,
                   voice: str | None) -> dict:
        messages = [message for _, message in self.items]
        if instructions:
            messages = [{"role": "system", "content": instructions}] + messages
        body: dict[str, Any] = {"model": self.config.model, "messages": messages}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if modalities == ("audio",):
            model = self.app[MODELS][self.config.model]
            if not has_speakers(model) or "generate" not in model.stages:
                raise Unprocessable(f"model {model.name!r} does not speak; use output_modalities [\"text\"]",
                                    param="output_modalities")
            voice = voice or (voices(model) or [None])[0]
            if voice is None:
                raise BadRequest("choose a voice with session.update", param="session.audio.output.voice")
            body.update(modalities=["text", "audio"], audio={"voice": voice, "format": "pcm16"})
        return body

    async def _respond(self, response_id: str, modalities: tuple[str, ...], parsed, body: dict) -> None:
        """Run one response to its end and send its events; cancellation (response.cancel, the client
        gone) cancels its request upstream through the generators' own clean-up."""
        send = self.socket.send
        item_id = _new_id("item")
        await send({"type": "response.created", "response": self._response_json(response_id, "in_progress", [])})
        item = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        await send({"type": "response.output_item.added", "response_id": response_id, "output_index": 0,
                    "item": item})
        where = {"response_id": response_id, "item_id": item_id, "output_index": 0, "content_index": 0}
        try:
            if modalities == ("audio",):
                text, usage = await self._speak(parsed, body, where)
                content = [{"type": "output_audio", "transcript": text}]
            else:
                text, usage = await self._write(parsed, where)
                content = [{"type": "output_text", "text": text}]
        except SessionClosed:   # the client is gone: nobody to tell
            raise
        except Exception as exc:   # an OmniError, or a bug: logged, and the response still ends
            error = exc if isinstance(exc, OmniError) else \
                unexpected(exc, f"realtime session {self.id}: response {response_id}", response_id)
            error.request_id = error.request_id or response_id
            self.response_ended = response_id
            await self.socket.send_error(error)
            await send({"type": "response.done", "response": self._response_json(
                response_id, "failed", [], {"type": "failed", "error": {"type": error.error_type,
                                                                        "message": error.message}})})
            return
        done_item = {**item, "status": "completed", "content": content}
        await send({"type": "response.output_item.done", "response_id": response_id, "output_index": 0,
                    "item": done_item})
        if self.response_meta["conversation_id"] is not None:   # an out-of-band reply stays out of it
            self._add_item(item_id, {"role": "assistant", "content": text})
        self.response_ended = response_id
        await send({"type": "response.done", "response": self._response_json(response_id, "completed", [done_item],
                                                                              usage=usage)})

    async def _speak(self, parsed, body: dict, where: dict) -> tuple[str, dict]:
        chat = await start_spoken_chat(self.app, parsed, body, streamed=True, prefix="resp",
                                       speed=self.config.speed)
        detok = IncrementalDetokenizer(chat.gen.model.tokenizer)
        send = self.socket.send
        try:
            async for item in chat.items:
                if isinstance(item, AudioChunk):
                    await send({"type": "response.output_audio.delta", **where, "delta": item.data})
                    continue
                chat.gen.completion_tokens += len(item.tokens)
                detok.add(item.tokens, final=bool(item.finish_reason))
                delta = detok.take(final=bool(item.finish_reason))
                if delta:
                    await send({"type": "response.output_audio_transcript.delta", **where, "delta": delta})
        finally:
            await chat.items.aclose()   # an early exit cancels the request upstream
        text = detok.text
        await send({"type": "response.output_audio.done", **where})
        await send({"type": "response.output_audio_transcript.done", **where, "transcript": text})
        return text, _usage(chat.gen)

    async def _write(self, parsed, where: dict) -> tuple[str, dict]:
        gen = await off_loop(self.app, generation.prepare, self.app[MODELS][self.config.model], parsed, "resp")
        deadline = time.time() + self.app[CONFIG].request_timeout_s
        chunks = generation.run(self.app[BUS], gen, deadline)
        text = []
        try:
            async for chunk in chunks:
                if chunk.text:
                    text.append(chunk.text)
                    await self.socket.send({"type": "response.output_text.delta", **where, "delta": chunk.text})
        finally:
            await chunks.aclose()
        await self.socket.send({"type": "response.output_text.done", **where, "text": "".join(text)})
        return "".join(text), _usage(gen)

    # ------------------------------------------------------------------ helpers

    def _add_item(self, item_id: str, message: dict) -> None:
        self.items.append((item_id, message))
        del self.items[:-MAX_ITEMS]
        sizes = [_message_bytes(m) for _, m in self.items]
        total = sum(sizes)
        while total > MAX_CONVERSATION_BYTES and len(self.items) > 1:
            total -= sizes.pop(0)
            del self.items[0]

    async def _announce_item(self, item_id: str, role: str, content: list) -> None:
        item = {"id": item_id, "type": "message", "role": role, "status": "completed", "content": content}
        previous = self.items[-2][0] if len(self.items) > 1 else None
        await self.socket.send({"type": "conversation.item.added", "previous_item_id": previous, "item": item})
        await self.socket.send({"type": "conversation.item.done", "previous_item_id": previous, "item": item})

    def _response_json(self, response_id: str, status: str, output: list, details: dict | None = None,
                       usage: dict | None = None) -> dict:
        return {"id": response_id, "object": "realtime.response", "status": status, "status_details": details,
                "output": output, "output_modalities": list(self.config.output_modalities), "usage": usage,
                **self.response_meta}


def _message_bytes(message: dict) -> int:
    """What a conversation item holds: its text in characters, its audio clips' base64."""
    content = message["content"]
    if isinstance(content, str):
        return len(content)
    return sum(len(p["text"]) if p["type"] == "text" else len(p["input_audio"]["data"]) for p in content)


def _usage(gen: generation.Generation) -> dict:
    return {"input_tokens": gen.prompt_tokens, "output_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


async def realtime(request: web.Request) -> web.StreamResponse:
    models = request.app[MODELS]
    name = request.query.get("model")
    config = SessionConfig(model=_model(models, name, "model").name if name else _default_model(models))
    if config.output_modalities == ("audio",) and not has_speakers(models[config.model]):
        config = dataclasses.replace(config, output_modalities=("text",))
    async with event_socket(request, ROUTE) as socket:
        await RealtimeSession(socket, config).run()
    return socket.ws


def add_realtime_routes(app: web.Application) -> None:
    install(app)
    app.router.add_get("/v1/realtime", realtime)
