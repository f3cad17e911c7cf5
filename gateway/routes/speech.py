"""Speech out: ``POST /v1/audio/speech`` and chat completions with ``modalities: ["text", "audio"]``:
their parsing and checks, the speech request on the bus (:func:`speak`), the routes, and the chat
answers; the streamed answers of ``/v1/audio/speech`` are rendered by ``speech_responses.py``.

Life of a chat request with audio out through the gateway::

    parse_chat (modalities, audio {voice, format}) ──generation.prepare──▶ prompt ids, stages
        ──▶ Submit(stages … decode, generate; TextParams with .speech = SpeechParams) ──▶ SpeechStream:
        TokenDeltas (prefill, decode: reordered, de-duplicated) → transcript text, then MediaResults
        (generate: the encoded audio in chunks, kept by index, duplicates from a retried stage dropped)
        ──▶ non-stream: message.audio {id, data: base64 of the whole file, transcript, expires_at}
        ──▶ stream: SSE deltas {"audio": {"id", "transcript"}} as text arrives, then
            {"audio": {"id", "data"}} per chunk as it arrives; the chunks' bytes concatenated are the file

A streamed chat asks the worker for incremental synthesis (``SpeechParams.stream``): its
first audio chunk leaves while the talker is still speaking, instead of after the whole utterance.
Such audio is PCM as it comes (``pcm16``), or a WAV whose header says "unknown length" (0xFFFFFFFF;
readers take the data to the end); FLAC is still synthesised whole. Streamed samples differ slightly
from a non-streamed answer with the same seed (token2wav runs per window of codes with its own noise:
``workers/speech/stream.py``) but are the same on every run and every worker, so a resubmitted stream
still resumes by chunk index.

Life of ``POST /v1/audio/speech``::

    {model, input, voice, response_format wav|pcm|flac, speed} ──▶ prompt = the chat template of one
        user turn holding the text + the assistant header, then the text itself + <|im_end|>:
        the text is teacher-forced as the thinker's reply, so prefill alone computes every hidden
        state the talker needs (``SpeechParams.reply_start`` marks where the reply begins; no decode)
        ──▶ Submit(stages prefill, generate) ──▶ the audio chunks, joined into the HTTP body (collected
        first, so a failure still gets its status; the worker synthesises the utterance whole)
        ──▶ ``stream_format: "audio"`` (asked for explicitly): incremental synthesis, each chunk written
        to a chunked body as it arrives (a failure after the first chunk breaks the connection:
        the status is gone)
        ──▶ ``stream_format: "sse"``: the same incremental synthesis (the same bytes), as OpenAI's
        events: ``{"type": "speech.audio.delta", "audio": <base64>}`` per chunk, then
        ``{"type": "speech.audio.done", "usage": {input_tokens, output_tokens, total_tokens}}``; a
        failure after the first event is one last ``{"type": "error", "error": …, "request_id",
        "stage"}`` event (the error body of every other route), then the end of the stream
        (both streams: ``speech_responses.py``, which also says how FLAC and ``usage`` arrive)

Why teacher forcing: Qwen2.5-Omni's talker speaks the text whose thinker states it reads; states of
the text as the assistant's own reply are exactly what decode would have produced, had the thinker
said it. Voices are the model's speakers (``spk_dict.json`` beside the weights; the worker checks
again). Formats: ``wav`` (16-bit PCM RIFF, 24 kHz mono), ``pcm`` (raw 16-bit LE; chat: ``pcm16``),
``flac`` (only when the ``soundfile`` package is installed here — else 400); mp3/opus/aac: 400.
``speed`` resamples (pitch moves with it). Extensions (``extra_body``): ``seed``, and
``max_audio_tokens`` (the talker's codec-token budget; default in proportion to the text,
``SpeechParams.codes_for``). The talker's and token2wav's random draws come from a
seed (``seed`` field, else chosen here), so a stage retried elsewhere speaks the same; a resubmission
after a lost worker starts over and skips what the client already has.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import random
import time
import uuid
from typing import Any, AsyncIterator

import msgspec
from aiohttp import web

from omnirelay.broker import protocol as p
from omnirelay.errors import BadRequest, DeadlineExceeded, NotFound, OmniError, Unprocessable
from omnirelay.handoffs import MediaInputs
from omnirelay.request_params import RequestParams
from omnirelay.speech_params import MAX_CODES, MAX_SEED, SpeechParams

from .. import generation
from ..app_keys import BUS, CONFIG, MODELS, SPOKEN_ANSWERS
from ..bus import BusClient, RequestStream, StreamEvent
from ..cpu_work import off_loop
from ..detokenizer import IncrementalDetokenizer
from ..models import ModelRuntime
from ..request_body import json_body
from ..request_record import RequestRecord, Usage, open_record
from ..resubmit import Submissions
from ..schema import CHAT_AUDIO_FORMATS
from ..spoken_answers import SpokenAnswers
from ..sse import SseWriter
from ..usage import UsageReport, report_for
from .speech_responses import SpokenAudio, speech_body_stream, speech_event_stream

MAX_INPUT_CHARS = 4096           # OpenAI's bound on ``input``
AUDIO_TTL_S = 3600               # ``expires_at``: until then a later turn may name the answer by its id
MIMES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}
UNSUPPORTED_FORMATS = ("mp3", "opus", "aac")
STREAM_FORMATS = ("sse", "audio")


def flac_available() -> bool:
    try:
        import soundfile  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def voices(model: ModelRuntime) -> list[str] | None:
    """The model's speaker names (None when only a pickled table exists: the worker then checks the
    voice), as read once with the model (gateway/speech_facts.py)."""
    names = model.speech.voices
    return None if names is None else list(names)


def _speech_params(model: ModelRuntime, voice: Any, fmt: str, body: dict, **extra) -> SpeechParams:
    names = voices(model)
    if not isinstance(voice, str) or not voice:
        raise BadRequest("'voice' must be a non-empty string", param="voice")
    if names is not None and voice not in names:
        # Names match whatever their case ("Vivian" as Qwen3-TTS documents it, "vivian" as stored).
        folded = [name for name in names if name.casefold() == voice.casefold()]
        if len(folded) != 1:
            raise BadRequest(f"voice {voice!r} is not available for model {model.name!r}; choose one of "
                             f"{', '.join(names)}", param="voice")
        voice = folded[0]
    if fmt == "flac" and not flac_available():
        raise BadRequest("response_format 'flac' needs the soundfile package, which this server does not have; "
                         "use 'wav' or 'pcm'", param="response_format")
    seed = body.get("seed")
    if seed is None:
        seed = random.randrange(MAX_SEED)
    max_codes = body.get("max_audio_tokens", 0)   # 0: in proportion to the text (SpeechParams.codes_for)
    if isinstance(max_codes, bool) or not isinstance(max_codes, int) or not 0 <= max_codes <= MAX_CODES:
        raise BadRequest(f"'max_audio_tokens' must be an integer between 1 and {MAX_CODES} (0: automatic)",
                         param="max_audio_tokens")
    return SpeechParams(voice=voice, format=fmt, seed=seed, max_codes=max_codes, **extra)


def _speech_model(models: dict, name: Any) -> ModelRuntime:
    if not isinstance(name, str) or not name:
        raise BadRequest("'model' must be a non-empty string", param="model")
    model = models.get(name)
    if model is None:
        raise NotFound(f"model {name!r} does not exist; see GET /v1/models", param="model")
    if not isinstance(model, ModelRuntime) or "generate" not in model.stages or not has_speakers(model):
        raise BadRequest(f"model {name!r} does not produce speech", param="model")
    return model


def has_speakers(model: ModelRuntime) -> bool:
    """Whether the model directory has a speaker table (a Qwen2.5-Omni with its talker, a Qwen3-TTS)."""
    return model.speech.has_speakers


def codes_per_second(model: ModelRuntime) -> float:
    """The talker's codes per second of audio (``usage.output_tokens`` of a streamed answer)."""
    return model.speech.codes_per_second


# ---------------------------------------------------------------------- the bus side


class AudioChunk:
    __slots__ = ("data",)

    def __init__(self, data: str):
        self.data = data   # base64 of the chunk's bytes, as the worker sent it


class SpeechStream(RequestStream):
    """Tokens and audio chunks of one submission. Tokens are delivered in position order from
    ``skip_tokens`` on, chunks in index order from ``skip_chunks`` on (what an earlier submission of
    the same client request already delivered). Done when the audio's last chunk and the text's last
    token are delivered (a talker reading a streamed reply may finish before the thinker does)."""

    def __init__(self, request_id: str, deadline: float, mime: str, skip_tokens: int, skip_chunks: int,
                 text_expected: bool = True):
        super().__init__(request_id, deadline)
        self.mime = mime
        self.text_expected = text_expected   # False for /v1/audio/speech: prefill's one token is nobody's
        self.skip_tokens = skip_tokens
        self.text_done = False
        self.next_chunk = 0
        self.skip_chunks = skip_chunks
        self.chunks_total: int | None = None
        self._early_chunks: dict[int, str] = {}

    def on_delta(self, delta: p.TokenDelta) -> None:
        if self.text_done or self.finished or not self.text_expected:
            return
        for i, token in enumerate(delta.token_ids):
            position = delta.start + i
            last = i == len(delta.token_ids) - 1
            if position >= self.next_position:
                self._early[position] = (token, delta.finish_reason if last else "")
        ready, reason = [], ""
        while self.next_position in self._early and not reason:
            token, reason = self._early.pop(self.next_position)
            if self.next_position >= self.skip_tokens:
                ready.append(token)
            self.next_position += 1
        if ready or reason:
            self._queue.put_nowait(StreamEvent(ready, reason))
        if reason:
            self.text_done = True
            if self.next_position < 2:
                # A one-token reply (EOS at once) ends at prefill: the talker needs the states of
                # two tokens, so nothing is spoken and no audio will come.
                self.finished = True
                self._queue.put_nowait(StreamEvent([], "audio_done"))
            else:
                self._finish_when_complete()

    def on_media(self, media: p.MediaResult) -> None:
        if self.finished or media.index < self.next_chunk:
            return
        if media.mime != self.mime:
            self.on_error(OmniError(f"worker sent {media.mime!r}, expected {self.mime}", request_id=self.request_id,
                                    stage="generate"))
            return
        self._early_chunks.setdefault(media.index, media.data)
        if media.finish:
            self.chunks_total = media.index + 1
        while self.next_chunk in self._early_chunks:
            data = self._early_chunks.pop(self.next_chunk)
            if self.next_chunk >= self.skip_chunks:
                self._queue.put_nowait(AudioChunk(data))
            self.next_chunk += 1
        self._finish_when_complete()

    def _finish_when_complete(self) -> None:
        """Done once the audio's last chunk and (when text is expected) the text's last token are in:
        with a streamed hand-off the talker can stop before the thinker does."""
        if self.finished or self.chunks_total is None or self.next_chunk < self.chunks_total:
            return
        if self.text_expected and not self.text_done:
            return
        self.finished = True
        self._queue.put_nowait(StreamEvent([], "audio_done"))

    async def items(self) -> AsyncIterator[StreamEvent | AudioChunk]:
        """Yield token events and audio chunks until the audio is complete; raise the request's error."""
        while True:
            remaining = self.deadline - time.time()
            try:
                item = await asyncio.wait_for(self._queue.get(), timeout=max(0.0, remaining))
            except asyncio.TimeoutError:
                raise DeadlineExceeded("request deadline passed while waiting for audio",
                                       request_id=self.request_id) from None
            if isinstance(item, OmniError):
                raise item
            if isinstance(item, StreamEvent) and item.finish_reason == "audio_done":
                return
            yield item


async def speak(bus: BusClient, *, model: str, stages: tuple[str, ...], prompt_token_ids: list[int],
                params: RequestParams, inputs: MediaInputs | None, mime: str, deadline: float, request_id: str,
                text_expected: bool) -> AsyncIterator[StreamEvent | AudioChunk]:
    """Submit one speech request and yield its token events (when ``text_expected``) and audio chunks.
    Resubmits from scratch after a lost worker or broker (same seeds: same tokens and audio),
    skipping what was already yielded; waits briefly for a role without a live worker; cancels
    upstream when the caller goes away or fails (``resubmit.Submissions``)."""
    tokens_out = chunks_out = 0
    submit = p.Submit(request_id=request_id, model=model, stages=list(stages), prompt_token_ids=prompt_token_ids,
                      params=params, deadline=deadline, reply_to=bus.reply_to, reply_key=bus.reply_key,
                      **({"inputs": inputs} if inputs else {}))

    def note() -> str:
        return f"resubmitting ({tokens_out} tokens, {chunks_out} audio chunks delivered)"

    async with Submissions(bus, request_id, deadline, retry_note=note) as submissions:
        while not submissions.done:
            async with submissions.attempt() as upstream_id:
                stream = SpeechStream(upstream_id, deadline, mime, tokens_out, chunks_out, text_expected)
                await bus.submit(msgspec.structs.replace(submit, request_id=upstream_id), stream)
                async for item in stream.items():
                    if isinstance(item, AudioChunk):
                        chunks_out += 1
                    else:
                        tokens_out += len(item.tokens)
                    yield item


# ---------------------------------------------------------------------- POST /v1/audio/speech


def _speech_format(body: dict) -> str:
    fmt = body.get("response_format")
    if fmt is None:
        return "wav"   # OpenAI's default is mp3, which this server cannot encode
    if not isinstance(fmt, str):
        raise BadRequest("'response_format' must be a string: wav, pcm or flac", param="response_format")
    if fmt in UNSUPPORTED_FORMATS:
        raise BadRequest(f"response_format {fmt!r} is not supported by this server; use 'wav', 'pcm' or 'flac'",
                         param="response_format")
    if fmt not in MIMES:
        raise BadRequest(f"'response_format' must be one of wav, pcm, flac, got {fmt!r}", param="response_format")
    return fmt


def _reply_end_token(model: ModelRuntime) -> int:
    """The token that ends an assistant turn (``<|im_end|>`` in Qwen's ChatML)."""
    token = model.tokenizer.convert_tokens_to_ids("<|im_end|>")
    return token if isinstance(token, int) and token >= 0 else int(model.tokenizer.eos_token_id)


@dataclasses.dataclass
class SpeechJob:
    """A validated speech request (``input`` → audio), ready to submit: ``prompt_token_ids`` hold the
    chat prompt plus the teacher-forced reply; ``text_tokens`` how many of them are the text."""

    model: ModelRuntime
    fmt: str
    params: SpeechParams
    prompt_token_ids: list[int]
    text_tokens: int
    stages: tuple[str, ...]
    request_id: str = dataclasses.field(default_factory=lambda: f"speech-{uuid.uuid4().hex}")


def prepare_speech(models: dict, body: dict, *, streamed: bool) -> SpeechJob:
    """Validate ``{model, input, voice, response_format, speed, seed, max_audio_tokens}`` (400 naming
    the param) into a :class:`SpeechJob`; ``streamed`` asks the worker for incremental synthesis."""
    model = _speech_model(models, body.get("model"))
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise BadRequest("'input' must be a non-empty string", param="input")
    if len(text) > MAX_INPUT_CHARS:
        raise BadRequest(f"'input' is longer than {MAX_INPUT_CHARS} characters", param="input")
    fmt = _speech_format(body)
    speed = body.get("speed", 1.0)
    prompt = model.encode_chat([{"role": "user", "content": text}])
    reply = model.encode_client_text(text) + [_reply_end_token(model)]   # as the prompt reads it
    params = _speech_params(model, body.get("voice"), fmt, body, speed=speed, reply_start=len(prompt), stream=streamed)
    ids = prompt + reply
    if len(ids) >= model.max_model_len:
        raise BadRequest(f"'input' takes {len(ids)} tokens with its prompt; this model's context is "
                         f"{model.max_model_len}", param="input")
    stages = tuple(s for s in model.stages if s in ("prefill", "generate"))
    return SpeechJob(model, fmt, params, ids, len(reply), stages)


async def prepare(app: web.Application, body: dict, *, streamed: bool) -> SpeechJob:
    """:func:`prepare_speech` on the app's CPU pool: templating and tokenizing the input (up to
    MAX_INPUT_CHARS) never run on the event loop. The one way the speech routes prepare a request."""
    return await off_loop(app, prepare_speech, app[MODELS], body, streamed=streamed)


def speech_items(bus: BusClient, job: SpeechJob, deadline: float) -> AsyncIterator[StreamEvent | AudioChunk]:
    """The audio chunks of ``job`` as they arrive (see :func:`speak`)."""
    return speak(bus, model=job.model.name, stages=job.stages, prompt_token_ids=job.prompt_token_ids,
                 params=job.params, inputs=None, mime=MIMES[job.fmt], deadline=deadline,
                 request_id=job.request_id, text_expected=False)


async def audio_speech(request: web.Request) -> web.Response:
    body = await json_body(request)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if body.get("instructions"):
        raise Unprocessable("'instructions' are not supported: this model's voices take no style prompt",
                            param="instructions")
    stream_format = body.get("stream_format")
    if stream_format is not None and stream_format not in STREAM_FORMATS:
        raise Unprocessable(f"stream_format {stream_format!r} is not supported; 'audio' streams the file as the "
                            "response body, 'sse' as speech.audio.delta events", param="stream_format")
    streamed = stream_format is not None
    job = await prepare(request.app, body, streamed=streamed)
    model, fmt, params, ids, request_id = job.model, job.fmt, job.params, job.prompt_token_ids, job.request_id
    stages = job.stages
    # input_tokens as usage counts them (the whole speech prompt); text_tokens: the input text.
    record = open_record(request, model.name, request_id, usage=Usage(prompt_tokens=len(ids)), log_usage=False,
                         stages="+".join(stages), input_tokens=len(ids), text_tokens=job.text_tokens,
                         voice=params.voice, format=fmt, seed=params.seed, stream_format=stream_format)
    items = speech_items(request.app[BUS], job, time.time() + request.app[CONFIG].request_timeout_s)
    parts = []
    try:
        if streamed:
            if stream_format == "audio":
                response, error = await speech_body_stream(request, items, MIMES[fmt], request_id)
            else:
                spoken = SpokenAudio(fmt, params.speed, codes_per_second(model))
                response, error = await speech_event_stream(request, items, spoken,
                                                            len(ids), request_id)
            if error is not None:   # after the 200 went out: the connection was broken instead
                record.failed(error)
            return response
        # The whole file is collected before answering, so a failure still gets its status code;
        # the worker synthesises it whole (SpeechParams.stream off), as transformers' generate would.
        async for item in items:
            parts.append(base64.b64decode(item.data))
    finally:
        await items.aclose()
    return web.Response(body=b"".join(parts), content_type=MIMES[fmt], headers={"X-Request-Id": request_id})


# ---------------------------------------------------------------------- chat with audio out


@dataclasses.dataclass
class SpokenChat:
    """A chat request with a spoken answer, submitted: ``items`` yields its token events (the
    transcript) and audio chunks; closing it cancels the request upstream."""

    gen: generation.Generation
    fmt: str
    params: SpeechParams
    items: AsyncIterator[StreamEvent | AudioChunk]


async def start_spoken_chat(app: web.Application, parsed, body: dict, *, streamed: bool, prefix: str = "chatcmpl",
                            deadline: float | None = None, speed: float = 1.0) -> SpokenChat:
    """Validate a chat request with ``modalities`` holding audio and start it (nothing is sent before
    the first item is awaited). ``streamed`` asks for incremental synthesis; ``speed`` plays the
    answer faster or slower (resampled, as ``/v1/audio/speech`` does). The prompt is templated,
    tokenized and its media decoded on the app's CPU pool, never on the event loop."""
    model = _speech_model(app[MODELS], parsed.model)
    if parsed.stop:
        raise Unprocessable("'stop' strings are not supported with audio output", param="stop")
    gen = await off_loop(app, generation.prepare, model, parsed, prefix)
    if gen.reasoning is not None and not gen.reasoning.closed_in_prompt:
        # The talker speaks every token the thinker writes: it would read the reasoning aloud.
        raise Unprocessable("a spoken answer from a thinking model needs its thinking off "
                            "(chat_template_kwargs: {\"enable_thinking\": false}): the reasoning would be spoken",
                            param="modalities")
    if gen.max_tokens < 2 or "decode" not in gen.stages:
        raise BadRequest("audio output needs a reply of at least 2 tokens: set max_tokens >= 2", param="max_tokens")
    fmt = CHAT_AUDIO_FORMATS[parsed.audio["format"]]
    params = _speech_params(model, parsed.audio["voice"], fmt, body, speed=speed, stream=streamed)
    text_params = msgspec.structs.replace(generation.text_params(gen, 0), speech=params)
    deadline = deadline if deadline is not None else time.time() + app[CONFIG].request_timeout_s
    # A LoRA adapter's request runs on its base model's workers (gateway/lora.py).
    items = speak(app[BUS], model=model.base_name, stages=gen.stages, prompt_token_ids=gen.prompt_token_ids,
                  params=text_params, inputs=gen.inputs, mime=MIMES[fmt], deadline=deadline,
                  request_id=gen.request_id, text_expected=True)
    return SpokenChat(gen, fmt, params, items)


async def chat_with_audio(request: web.Request, parsed, body: dict) -> web.StreamResponse:
    """A chat completion whose answer is spoken too (``modalities: ["text", "audio"]``)."""
    chat = await start_spoken_chat(request.app, parsed, body, streamed=parsed.stream)
    gen, fmt, params, items, model = chat.gen, chat.fmt, chat.params, chat.items, chat.gen.model
    audio_id = f"audio_{uuid.uuid4().hex}"
    record = open_record(request, model.name, gen.request_id, usage=gen, stages="+".join(gen.stages),
                         voice=params.voice, format=fmt, seed=params.seed)
    try:
        if parsed.stream:
            return await _chat_audio_stream(request, gen, items, audio_id, record)
        return await _chat_audio_full(gen, items, audio_id, record, request.app[SPOKEN_ANSWERS],
                                      report_for(gen.request, request.app[CONFIG]))
    finally:
        await items.aclose()


async def _chat_audio_full(gen, items, audio_id: str, record: RequestRecord,
                           answers: SpokenAnswers, report: UsageReport) -> web.Response:
    detok = IncrementalDetokenizer(gen.model.tokenizer)
    finish, audio = "stop", []
    async for item in items:
        if isinstance(item, AudioChunk):
            audio.append(base64.b64decode(item.data))
            continue
        record.tokens(len(item.tokens))
        gen.completion_tokens += len(item.tokens)
        detok.add(item.tokens, final=bool(item.finish_reason))
        finish = item.finish_reason or finish
    text = detok.take(final=True)
    expires_at = int(time.time()) + AUDIO_TTL_S
    message = {"role": "assistant", "content": None,
               "audio": {"id": audio_id, "data": base64.b64encode(b"".join(audio)).decode("ascii"),
                         "transcript": text, "expires_at": expires_at}}
    if not audio:   # a one-token reply is not spoken: the text alone
        message = {"role": "assistant", "content": text, "audio": None}
    else:   # a later turn may give this answer back by its id (gateway/spoken_answers.py)
        answers.keep(audio_id, text, expires_at)
    body = {"id": gen.request_id, "created": generation.now(), "model": gen.model.name, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": report.answer(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)}
    return web.json_response(body, headers={"X-Request-Id": gen.request_id})


async def _chat_audio_stream(request: web.Request, gen, items, audio_id: str,
                             record: RequestRecord) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": gen.request_id})
    sse = SseWriter(response, {"id": gen.request_id, "created": generation.now(), "model": gen.model.name,
                               "object": "chat.completion.chunk"}, request.app[CONFIG].stream_write_timeout_s)
    # A spoken answer's stream sends no continuous usage (schema.py refuses to be asked for it; under
    # --enable-force-include-usage it has the final usage chunk alone): gateway/usage.py.
    report = report_for(gen.request, request.app[CONFIG])

    async def send(payload: dict) -> None:
        await sse.write(b"data: " + json.dumps({**sse.base, **payload}, separators=(",", ":")).encode() + b"\n\n")

    def choice(delta: dict, finish: str | None = None) -> dict:
        return {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    detok = IncrementalDetokenizer(gen.model.tokenizer)
    first = await anext(items, None)   # errors before anything arrives still get a proper status
    await response.prepare(request)
    finish, transcript = "stop", []
    try:
        await send(choice({"role": "assistant", "content": None}))
        item = first
        while item is not None:
            if isinstance(item, AudioChunk):
                await send(choice({"audio": {"id": audio_id, "data": item.data}}))
            else:
                record.tokens(len(item.tokens))
                gen.completion_tokens += len(item.tokens)
                detok.add(item.tokens, final=bool(item.finish_reason))
                finish = item.finish_reason or finish
                text = detok.take(final=bool(item.finish_reason))
                if text:
                    transcript.append(text)
                    await send(choice({"audio": {"id": audio_id, "transcript": text}}))
            item = await anext(items, None)
        expires_at = int(time.time()) + AUDIO_TTL_S
        # kept first: a client may send the next turn as soon as it reads the id's last event
        request.app[SPOKEN_ANSWERS].keep(audio_id, "".join(transcript), expires_at)
        await send(choice({"audio": {"id": audio_id, "expires_at": expires_at}}, finish))
        if report.final:
            await send({"choices": [], "usage": report.last_chunk(gen.prompt_tokens, gen.completion_tokens,
                                                                  gen.cached_tokens)})
    except OmniError as exc:
        # Headers are gone: the error travels as the last event, in the same body shape.
        record.failed(exc)
        await sse.send_error(exc)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def add_speech_routes(app: web.Application) -> None:
    app.router.add_post("/v1/audio/speech", audio_speech)
