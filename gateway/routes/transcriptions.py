"""``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations``: speech to text, served by
an omni model's thinker through the chat path (audio → encode → prefill → decode).

Life of a request through this module::

    multipart form (``file`` + fields; 413 over max_body_bytes, 408 past read_timeout_s)
    ──▶ the model must hear (an omni model with media rules): else 422 naming ``model``
    ──▶ the file decoded (WAV as it is; FLAC, and MP3 where this libsndfile decodes it, through
        soundfile into 16-bit WAV): 400 naming ``file`` when it is no audio we can read
    ──▶ one user message: the audio part, then the instruction — "Transcribe the audio." (with
        ``language`` and ``prompt`` as context) or "Translate the speech into English."
    ──▶ gateway/schema.py parse_chat + generation.prepare (the clip's placeholders, its 30 s bound,
        the context) ──▶ generation.run ──▶ the answer in ``response_format``:

* ``json`` (default): ``{"text", "usage": {"type": "duration", "seconds"}}`` (vLLM's usage);
* ``text``: the text as ``text/plain``;
* ``verbose_json``: ``{"task", "language", "duration", "text", "usage"}``; no ``segments`` or
  ``words`` (the thinker gives no timestamps: ``timestamp_granularities`` is a 422);
* ``srt`` / ``vtt``: one cue spanning the whole clip.

``stream: true`` (``json``/``text`` only) answers SSE: one event per text piece and a last one, then
``data: [DONE]``. Each event carries both shapes clients parse: OpenAI's typed event
(``{"type": "transcript.text.delta", "delta"}``, last ``{"type": "transcript.text.done", "text",
"usage"}``) and vLLM's chunk (``{"id", "object": "transcription.chunk", "created", "model",
"choices": [{"delta": {"content"}, "finish_reason", "stop_reason"}]}``), so the official client and
vLLM's clients read the same stream. ``language`` is an ISO-639-1 code, taken as a hint in the
instruction (nothing detects the spoken language: ``verbose_json`` reports the hint, or ``und``).
Sampling: ``temperature`` (default 0) and vLLM's extras (:data:`SAMPLING_FIELDS`); any other field
is a 422 naming it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import math
import re
import time
import wave

from aiohttp import web

from omnirelay.errors import BadRequest, OmniError, PayloadTooLarge, Unprocessable

from .. import generation
from ..app_keys import BUS, CONFIG, MODELS
from ..models import text_model
from ..request_body import RequestTimeout
from ..request_record import open_record
from ..schema import parse_chat
from ..sse import stream_slot

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
# vLLM's sampling extras on its transcription request: form field → type.
SAMPLING_FIELDS = {"seed": int, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
                   "presence_penalty": float, "frequency_penalty": float, "max_completion_tokens": int}
_FIELDS = {"model", "file", "language", "prompt", "temperature", "response_format", "stream", *SAMPLING_FIELDS}
_NOT_SERVED = ("timestamp_granularities", "timestamp_granularities[]", "include", "include[]",
               "chunking_strategy", "known_speaker_names", "known_speaker_names[]", "known_speaker_references[]")
_LANGUAGE = re.compile(r"^[a-z]{2,3}$")


def _decoders() -> tuple[str, ...]:
    """The container formats soundfile decodes here (MP3 needs libsndfile >= 1.1)."""
    try:
        import soundfile
    except ImportError:
        return ()
    return tuple(f for f in ("WAV", "FLAC", "MP3", "OGG") if f in soundfile.available_formats())


def wav_of(data: bytes) -> tuple[bytes, float]:
    """``data`` as a WAV file the media rules read, and its duration in seconds; 400 naming
    ``file`` when it is not audio this server decodes."""
    try:
        with wave.open(io.BytesIO(data)) as wav:   # PCM WAV goes as it is
            return data, wav.getnframes() / float(wav.getframerate() or 1)
    except (wave.Error, EOFError):
        pass
    decoders = _decoders()
    try:
        import soundfile

        pcm, rate = soundfile.read(io.BytesIO(data), dtype="int16", always_2d=True)
    except Exception as exc:   # soundfile.LibsndfileError, an unknown container, truncated data
        raise BadRequest(f"the file is not audio this server can decode ({', '.join(decoders).lower() or 'wav'}): "
                         f"{exc}"[:300], param="file") from None
    if not len(pcm):
        raise BadRequest("the audio file holds no samples", param="file")
    mono = pcm.mean(axis=1).round().astype("<i2") if pcm.shape[1] > 1 else pcm[:, 0].astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(mono.tobytes())
    return out.getvalue(), len(mono) / float(rate)


async def _form(request: web.Request) -> dict:
    """The multipart form: ``file`` as bytes, every other field as its string."""
    config = request.app[CONFIG]
    if not request.content_type.startswith("multipart/form-data"):
        raise BadRequest("send the audio as multipart/form-data with a 'file' field", param="file")
    try:
        async with asyncio.timeout(config.read_timeout_s):
            form = await request.post()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body exceeds {config.max_body_bytes} bytes", param="file") from None
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {config.read_timeout_s:g}s") from None
    except ValueError as exc:
        raise BadRequest(f"the multipart body cannot be read: {exc}", param="file") from None
    out: dict = {}
    for name, value in form.items():
        if name in _NOT_SERVED:
            raise Unprocessable(f"'{name.rstrip('[]')}' is not supported by this server", param=name.rstrip("[]"))
        if name not in _FIELDS:
            raise Unprocessable(f"'{name}' is not supported by this server", param=name)
        if name in out:
            raise BadRequest(f"'{name}' is given twice", param=name)
        if name == "file":
            if not isinstance(value, web.FileField):
                raise BadRequest("'file' must be an uploaded file", param="file")
            out[name] = value.file.read()
        elif isinstance(value, str):
            out[name] = value
        else:
            raise BadRequest(f"'{name}' must be a plain form field", param=name)
    return out


def _typed(form: dict, name: str, kind: type):
    value = form.get(name)
    if value is None or value == "":
        return None
    try:
        return kind(value)
    except ValueError:
        raise BadRequest(f"'{name}' must be {'an integer' if kind is int else 'a number'}", param=name) from None


def _instruction(task: str, language: str | None, prompt: str | None) -> str:
    if task == "translate":
        text = "Translate the speech in the audio into English. Answer with the translation only."
    else:
        text = "Transcribe the speech in the audio. Answer with the transcript only."
        if language:
            text += f" The speech is in the language with ISO-639-1 code '{language}'."
    if prompt:
        text += f" Context (earlier speech or spellings to follow): {prompt}"
    return text


def _timestamp(seconds: float, sep: str) -> str:
    millis = int(round(seconds * 1000))
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    return f"{hours:02d}:{minutes:02d}:{rest // 1000:02d}{sep}{rest % 1000:03d}"


def _subtitles(fmt: str, text: str, duration: float) -> str:
    cue = f"{_timestamp(0, ',' if fmt == 'srt' else '.')} --> {_timestamp(duration, ',' if fmt == 'srt' else '.')}"
    if fmt == "srt":
        return f"1\n{cue}\n{text.strip()}\n\n"
    return f"WEBVTT\n\n{cue}\n{text.strip()}\n\n"


async def _serve(request: web.Request, task: str) -> web.StreamResponse:
    form = await _form(request)
    model_name = form.get("model")
    if not model_name:
        raise BadRequest("'model' must be a non-empty string", param="model")
    model = text_model(request.app[MODELS], model_name)
    if model.media is None:
        raise Unprocessable(f"model {model_name!r} cannot hear: speech to text needs an omni model that takes "
                            "audio", param="model")
    if "file" not in form:
        raise BadRequest("'file' is required", param="file")
    fmt = form.get("response_format") or "json"
    if fmt not in FORMATS:
        raise BadRequest(f"'response_format' must be one of {', '.join(FORMATS)}", param="response_format")
    stream = form.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise BadRequest("'stream' must be true or false", param="stream")
    if stream == "true" and fmt not in ("json", "text"):
        raise Unprocessable(f"a {fmt} answer is not streamed; use json or text", param="stream")
    language = form.get("language") or None
    if language is not None and not _LANGUAGE.match(language):
        raise BadRequest("'language' must be an ISO-639-1 code such as 'en'", param="language")
    wav, duration = wav_of(form["file"])
    body = {"model": model_name, "temperature": _typed(form, "temperature", float) or 0.0,
            "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
                {"type": "text", "text": _instruction(task, language, form.get("prompt"))}]}]}
    for name, kind in SAMPLING_FIELDS.items():
        if _typed(form, name, kind) is not None:
            body[name] = _typed(form, name, kind)
    try:
        gen = generation.prepare(model, parse_chat(body), "trsc" if task == "transcribe" else "trsl")
    except OmniError as exc:
        if exc.param and exc.param.startswith("messages"):   # the clip (its length, its bytes)
            exc.param = "file"
        raise
    record = open_record(request, model.name, gen.request_id, usage=gen, stages="+".join(gen.stages), task=task)
    chunks = generation.run(request.app[BUS], gen, time.time() + request.app[CONFIG].request_timeout_s)
    if stream == "true":
        with stream_slot(request):
            async with contextlib.aclosing(chunks):
                return await _stream(request, gen, chunks, record)
    texts = []
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            record.tokens(len(chunk.token_ids))
            texts.append(chunk.text)
    text = "".join(texts).strip()
    headers = {"X-Request-Id": gen.request_id}
    if fmt == "text":
        return web.Response(text=text, content_type="text/plain", headers=headers)
    if fmt in ("srt", "vtt"):
        return web.Response(text=_subtitles(fmt, text, duration), headers=headers,
                            content_type="text/plain" if fmt == "srt" else "text/vtt")
    usage = {"type": "duration", "seconds": math.ceil(duration)}
    if fmt == "verbose_json":
        return web.json_response({"task": task, "language": language or "und", "duration": round(duration, 3),
                                  "text": text, "usage": usage}, headers=headers)
    return web.json_response({"text": text, "usage": usage}, headers=headers)


async def _stream(request: web.Request, gen: generation.Generation, chunks, record) -> web.StreamResponse:
    config = request.app[CONFIG]
    first = await anext(chunks, None)   # errors before the first token still get a proper status
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": gen.request_id})
    await response.prepare(request)
    base = {"id": gen.request_id, "object": "transcription.chunk", "created": generation.now(),
            "model": gen.model.name}

    async def send(event: dict) -> None:
        try:
            async with asyncio.timeout(config.stream_write_timeout_s):
                await response.write(b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n")
        except TimeoutError:
            raise ConnectionResetError(f"client did not read for {config.stream_write_timeout_s:.0f}s") from None

    texts, finish = [], None
    try:
        chunk = first
        while chunk is not None:
            record.tokens(len(chunk.token_ids))
            # The transcript is stripped of leading space, as the whole answer is.
            text = chunk.text.lstrip() if not "".join(texts) else chunk.text
            texts.append(text)
            finish = chunk.finish_reason or finish
            if text:
                await send({"type": "transcript.text.delta", "delta": text, **base,
                            "choices": [{"delta": {"content": text}, "finish_reason": None, "stop_reason": None}]})
            chunk = await anext(chunks, None)
        usage = {"type": "tokens", "input_tokens": gen.prompt_tokens, "output_tokens": gen.completion_tokens,
                 "total_tokens": gen.prompt_tokens + gen.completion_tokens, "prompt_tokens": gen.prompt_tokens,
                 "completion_tokens": gen.completion_tokens}
        await send({"type": "transcript.text.done", "text": "".join(texts).strip(), "usage": usage, **base,
                    "choices": [{"delta": {}, "finish_reason": finish or "stop", "stop_reason": None}]})
    except OmniError as exc:
        # Headers are gone: the error travels as the last event, in the error contract's body.
        record.failed(exc)
        await send(exc.to_body())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def transcriptions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "transcribe")


async def translations(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "translate")


def add_transcription_routes(app: web.Application) -> None:
    app.router.add_post("/v1/audio/transcriptions", transcriptions)
    app.router.add_post("/v1/audio/translations", translations)
