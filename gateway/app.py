"""The aiohttp application: OpenAI-compatible routes over the bus.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming as SSE ending
``data: [DONE]``, or one JSON body; several choices: gateway/choices.py), ``GET /v1/models``,
``POST /tokenize`` and ``POST /detokenize`` (vLLM's, gateway/tokenization.py), ``GET /health``
(200 only while every role each model needs has a live worker), ``GET /cluster`` (the broker's
view: workers, load, counters), ``GET /metrics`` (Prometheus), ``GET /status`` (a live page) and
``GET /openapi.json``.

With an API key configured, every ``/v1`` route and the tokenizer routes need ``Authorization:
Bearer <key>`` (compared in constant time); the probes (/health, /metrics, /cluster) stay open
unless ``protect_probes``.

State hangs off the app under typed keys; the bus client lives in a cleanup context, so it is
started only if the app starts and closed exactly once. Every error leaves as an OpenAI-style body
``{"error": {"message", "type", "param", "code"}, "request_id", "stage"}`` with its status.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import math
import time

from aiohttp import web

from omnirelay.errors import (BadRequest, NotFound, OmniError, Overloaded, PayloadTooLarge, Unauthorized, Unavailable,
                              Unprocessable)
from omnirelay.security import CurveKeys
from omnirelay.video_params import is_video_pipeline

from . import generation
from .bus import BusClient
from .config import GatewayConfig
from .metrics import GatewayMetrics
from .openapi import SpeechDoc, build_openapi
from .status_page import STATUS_HTML, StatusHistory
from .models import ModelRuntime
from .sse import SseWriter
from .schema import GenerationRequest, parse_chat, parse_completion
from .tool_calls import chat_format



log = logging.getLogger("omnirelay.gateway")

CONFIG = web.AppKey("config", GatewayConfig)
MODELS = web.AppKey("models", dict)
BUS = web.AppKey("bus", BusClient)
KEYS = web.AppKey("keys", object)
METRICS = web.AppKey("metrics", GatewayMetrics)
HISTORY = web.AppKey("history", StatusHistory)
STREAMS = web.AppKey("streams_per_client", collections.Counter)
_PROBES = ("/health", "/metrics", "/cluster", "/status", "/status.json")
_TOKENIZER_ROUTES = ("/tokenize", "/detokenize")   # vLLM's paths, outside /v1; they cost CPU, so keyed too


def create_app(config: GatewayConfig, keys: CurveKeys | None = None) -> web.Application:
    """``keys``: CURVE material for the bus (required when the broker or the token socket is off loopback)."""
    from .images import ImageModel, add_image_routes, is_image_pipeline   # images imports this module's keys
    from .videos import VideoModel, add_video_routes
    from .speech import add_speech_routes
    from .speech_ws import add_speech_stream_routes
    from .realtime import add_realtime_routes
    from .voices import add_voice_routes
    from .image_edits import add_image_edit_routes
    from .tokenization import add_tokenize_routes
    app = web.Application(middlewares=[_errors, _authenticate], client_max_size=config.max_body_bytes)
    app[CONFIG] = config
    app[KEYS] = keys
    app[METRICS] = GatewayMetrics()
    app[STREAMS] = collections.Counter()
    app[MODELS] = {m.name: VideoModel(m) if is_video_pipeline(m.path) else ImageModel(m) if is_image_pipeline(m.path)
                   else ModelRuntime(m) for m in config.models}
    app.cleanup_ctx.append(_bus_context)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    add_tokenize_routes(app)
    add_image_routes(app)
    add_image_edit_routes(app)
    add_speech_routes(app)
    add_speech_stream_routes(app)
    add_realtime_routes(app)
    add_voice_routes(app)
    add_video_routes(app)   # after the bus's cleanup context: its jobs are cancelled while the bus is open
    app.router.add_get("/health", health)
    app.router.add_get("/cluster", cluster)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/status", status_page)
    app.router.add_get("/status.json", status_json)
    return app


async def _bus_context(app: web.Application):
    config = app[CONFIG]
    bus = BusClient(config.broker, config.reply_host, app[KEYS], reply_port=config.reply_port)
    await bus.start()
    app[BUS] = bus
    history = StatusHistory(bus, app[METRICS])
    history.start()
    app[HISTORY] = history
    yield
    await history.stop()
    await bus.close()


class _MethodNotAllowed(OmniError):
    error_type, status, openai_type = "method_not_allowed", 405, "invalid_request_error"


class _RequestTimeout(OmniError):
    """The body did not arrive within ``read_timeout_s``: the client is gone or too slow to serve."""

    error_type, status, openai_type = "request_timeout", 408, "invalid_request_error"


def _error_response(error: OmniError) -> web.Response:
    # Every recoverable error (429 overloaded, 503 unavailable / worker lost, 502 transfer failed)
    # tells the client when trying again makes sense; the others would fail the same way again.
    if not error.recoverable:
        return web.json_response(error.to_body(), status=error.status)
    hint = error.retry_after if 0 < error.retry_after <= 3600 else 1   # a hint off the bus is not trusted blindly
    return web.json_response(error.to_body(), status=error.status, headers={"Retry-After": str(math.ceil(hint))})


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except _RequestTimeout as exc:
        return await _answer_and_close(request, exc)
    except OmniError as exc:
        return _error_response(exc)
    except web.HTTPRequestEntityTooLarge:
        return _error_response(PayloadTooLarge(f"request body exceeds {request.app[CONFIG].max_body_bytes} bytes"))
    except web.HTTPNotFound:
        return _error_response(NotFound(f"no route {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed:
        return _error_response(_MethodNotAllowed(f"{request.method} is not allowed on {request.path}"))
    except (web.HTTPException, ConnectionResetError):   # the latter: the client is gone, nobody to answer
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return _error_response(OmniError("internal server error"))


async def _answer_and_close(request: web.Request, error: OmniError) -> web.StreamResponse:
    """Send ``error`` and close the connection at once. Without the close, aiohttp would go on
    reading (and discarding) the rest of a body the client still dribbles, for its lingering time."""
    response = _error_response(error)
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()   # the answer is already in the socket; close() flushes it first
    return response


@web.middleware
async def _authenticate(request: web.Request, handler):
    config = request.app[CONFIG]
    if config.api_key and (request.path.startswith("/v1/") or request.path in _TOKENIZER_ROUTES
                           or (config.protect_probes and request.path in _PROBES)):
        supplied = request.headers.get("Authorization", "")
        expected = f"Bearer {config.api_key}"
        if not hmac.compare_digest(supplied.encode(), expected.encode()):
            raise Unauthorized("missing or invalid API key (Authorization: Bearer …)")
    return await handler(request)


async def _json_body(request: web.Request):
    config = request.app[CONFIG]
    try:
        # One deadline for the whole body: a client sending it byte by byte cannot reset it.
        async with asyncio.timeout(config.read_timeout_s):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body exceeds {config.max_body_bytes} bytes") from None
    except TimeoutError:
        raise _RequestTimeout(f"request body not received within {config.read_timeout_s:g}s") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None


def _model(request: web.Request, name: str) -> ModelRuntime:
    model = request.app[MODELS].get(name)
    if model is None:
        raise NotFound(f"model {name!r} does not exist; see GET /v1/models", param="model")
    if not isinstance(model, ModelRuntime):
        raise Unprocessable(f"model {name!r} generates images; use POST /v1/images/generations", param="model")
    return model


# ---------------------------------------------------------------------- generation routes


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _json_body(request)
    parsed = parse_chat(body)
    if "audio" in parsed.modalities:   # spoken answer too: talker + token2wav after decode (gateway/speech.py)
        from .speech import chat_with_audio
        return await chat_with_audio(request, parsed, body)
    if parsed.n > 1:
        return await _respond_choices(request, parsed, "chatcmpl", lambda: chat_format(_ChatFormat(), parsed.tools))
    gen = generation.prepare(_model(request, parsed.model), parsed, "chatcmpl")
    return await _respond(request, gen, chat_format(_ChatFormat(), parsed.tools))


async def completions(request: web.Request) -> web.StreamResponse:
    parsed = parse_completion(await _json_body(request))
    if parsed.n > 1 or parsed.prompts or parsed.echo:
        return await _respond_choices(request, parsed, "cmpl", _CompletionFormat)
    gen = generation.prepare(_model(request, parsed.model), parsed, "cmpl")
    return await _respond(request, gen, _CompletionFormat())


async def _respond_choices(request: web.Request, parsed: GenerationRequest, prefix: str,
                           make_format) -> web.StreamResponse:
    """Several choices (n > 1, a list of prompts) or echo: gateway/choices.py fans them out, rendering
    each choice with its own ``make_format()``."""
    from . import choices   # imports this module's keys
    return await choices.respond(request, choices.plan(_model(request, parsed.model), parsed, prefix), make_format)


# Logprobs answers (request asked: GenerationRequest.logprobs >= 0). Each format's ``logprobs``
# renders the tokens of one chunk (stream) or of the whole answer, given the text offset reached so
# far, and returns the object and the new offset. Token text: generation.token_text (each id decoded
# on its own); a logprob JSON cannot carry (-inf) becomes -9999.0, OpenAI's "very unlikely".
_UNLIKELY = -9999.0


def _logprob(value: float) -> float:
    return value if value >= _UNLIKELY else _UNLIKELY


class _ChatFormat:
    """``logprobs`` is OpenAI's ``{"content": [{"token", "logprob", "bytes", "top_logprobs": […]}]}``."""

    object_full, object_chunk = "chat.completion", "chat.completion.chunk"

    def first_delta(self) -> dict | None:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta(self, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": logprobs, "finish_reason": finish}

    def full(self, text: str, finish: str, logprobs: dict | None = None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}

    @staticmethod
    def logprobs(gen: generation.Generation, token_ids: list[int], logprobs: list, offset: int) -> tuple[dict, int]:
        def entry(token_id: int, value: float) -> dict:
            text = generation.token_text(gen, token_id)
            return {"token": text, "logprob": _logprob(value), "bytes": list(text.encode("utf-8"))}

        content = [{**entry(token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                   for token_id, lp in zip(token_ids, logprobs)]
        return {"content": content}, offset


class _CompletionFormat:
    """``logprobs`` is the legacy ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``:
    ``top_logprobs`` maps each position's alternatives' text to its logprob (null for
    ``logprobs: 0``); ``text_offset`` counts characters into the completion's text (no echo)."""

    object_full = object_chunk = "text_completion"

    def first_delta(self) -> dict | None:
        return None

    def delta(self, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def full(self, text: str, finish: str, logprobs: dict | None = None) -> dict:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def logprobs(gen: generation.Generation, token_ids: list[int], logprobs: list, offset: int) -> tuple[dict, int]:
        tokens, offsets = [], []
        for token_id in token_ids:
            tokens.append(generation.token_text(gen, token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        top = None
        if gen.request.logprobs > 0:
            top = []
            for lp in logprobs:
                alternatives: dict[str, float] = {}
                for token_id, value in lp.top:   # most likely first: of two equal texts, it keeps the likelier
                    alternatives.setdefault(generation.token_text(gen, token_id), _logprob(value))
                top.append(alternatives)
        return {"tokens": tokens, "token_logprobs": [_logprob(lp.logprob) for lp in logprobs], "top_logprobs": top,
                "text_offset": offsets}, offset


def _usage(gen: generation.Generation) -> dict:
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


async def _respond(request: web.Request, gen: generation.Generation, fmt) -> web.StreamResponse:
    timer = request.app[METRICS].timer(gen.model.name)
    outcome = "cancelled"
    try:
        if gen.request.stream:
            response = await _respond_stream(request, gen, fmt, timer)
        else:
            response = await _respond_full(request, gen, fmt, timer)
        outcome = "ok"
        return response
    except OmniError as exc:
        outcome = exc.error_type
        request.app[METRICS].errors.labels(exc.error_type, exc.stage or "gateway").inc()
        raise
    finally:
        timer.finish(gen.prompt_tokens, gen.completion_tokens, outcome, gen.resumes)
        if not request.app[CONFIG].disable_log_requests:
            log.info("request %s model=%s stages=%s prompt_tokens=%d completion_tokens=%d resumes=%d "
                     "outcome=%s e2e=%.3fs", gen.request_id, gen.model.name, "+".join(gen.model.stages),
                     gen.prompt_tokens, gen.completion_tokens, gen.resumes, outcome, timer.elapsed())


async def _respond_full(request: web.Request, gen: generation.Generation, fmt, timer) -> web.Response:
    deadline = time.time() + request.app[CONFIG].request_timeout_s
    texts, token_ids, logprobs, finish = [], [], [], "stop"
    async for chunk in generation.run(request.app[BUS], gen, deadline):
        timer.tokens(len(chunk.token_ids))
        texts.append(chunk.text)
        token_ids.extend(chunk.token_ids)
        logprobs.extend(chunk.logprobs)
        finish = chunk.finish_reason or finish
    rendered = fmt.logprobs(gen, token_ids, logprobs, 0)[0] if gen.request.logprobs >= 0 else None
    choice = fmt.full("".join(texts), finish, rendered)
    if gen.request.return_token_ids:
        choice["token_ids"] = token_ids
        choice["prompt_token_ids"] = gen.prompt_token_ids
    body = {"id": gen.request_id, "created": generation.now(), "model": gen.model.name, "object": fmt.object_full,
            "choices": [choice], "usage": _usage(gen)}
    return web.json_response(body, headers={"X-Request-Id": gen.request_id})


async def _respond_stream(request: web.Request, gen: generation.Generation, fmt, timer) -> web.StreamResponse:
    config = request.app[CONFIG]
    streams = request.app[STREAMS]
    client = request.remote or "?"
    if streams[client] >= config.max_streams_per_client:
        raise Overloaded(f"client {client} already holds {streams[client]} streams", retry_after=1)
    streams[client] += 1
    try:
        return await _stream(request, gen, fmt, timer)
    finally:
        streams[client] -= 1
        if not streams[client]:
            del streams[client]


async def _stream(request: web.Request, gen: generation.Generation, fmt, timer) -> web.StreamResponse:
    config = request.app[CONFIG]
    deadline = time.time() + config.request_timeout_s
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": gen.request_id})
    include_usage = gen.request.include_usage
    sse = SseWriter(response, {"id": gen.request_id, "created": generation.now(), "model": gen.model.name,
                               "object": fmt.object_chunk}, include_usage, config.stream_write_timeout_s)
    write, send = sse.write, sse.send

    stream = generation.run(request.app[BUS], gen, deadline)
    try:
        first = await anext(stream)   # errors before the first token still get a proper status
    except StopAsyncIteration:
        first = None
    await response.prepare(request)
    try:
        if fmt.first_delta() is not None:
            await send([fmt.first_delta()])
        chunk, text_offset = first, 0
        while chunk is not None:
            timer.tokens(len(chunk.token_ids))
            logprobs = None   # a chunk whose text is held back still sends its tokens' logprobs
            if gen.request.logprobs >= 0 and chunk.token_ids:
                logprobs, text_offset = fmt.logprobs(gen, chunk.token_ids, chunk.logprobs, text_offset)
            if chunk.text or chunk.finish_reason or logprobs:
                choice = fmt.delta(chunk.text, chunk.finish_reason or None, logprobs)
                if gen.request.return_token_ids:
                    choice["token_ids"] = chunk.token_ids
                await send([choice])
            chunk = await anext(stream, None)
        if include_usage:
            await send([], _usage(gen))
    except OmniError as exc:
        # Headers are gone: the error travels as the last event, in the same body shape.
        exc.request_id = exc.request_id or gen.request_id
        request.app[METRICS].errors.labels(exc.error_type, exc.stage or "gateway").inc()
        await sse.send_error(exc)
    finally:
        await stream.aclose()
    await write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


# ---------------------------------------------------------------------- other routes


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [m.card() for m in request.app[MODELS].values()]})


async def _live_roles(request: web.Request) -> dict[str, set[str]] | None:
    status = await request.app[BUS].status(request.app[CONFIG].status_timeout_s)
    if status is None:
        return None
    live: dict[str, set[str]] = {}
    for worker in status.workers:
        live.setdefault(worker["model"], set()).add(worker["role"])
    return live


async def health(request: web.Request) -> web.Response:
    live = await _live_roles(request)
    if live is None:
        raise Unavailable("broker did not answer", retry_after=1)
    missing = {name: sorted(set(m.stages) - live.get(name, set()))
               for name, m in request.app[MODELS].items()}
    missing = {k: v for k, v in missing.items() if v}
    if missing:
        raise Unavailable(f"no live worker for {missing}", retry_after=1)
    return web.json_response({"status": "ok"})


async def status_page(request: web.Request) -> web.Response:
    return web.Response(text=STATUS_HTML, content_type="text/html")


async def status_json(request: web.Request) -> web.Response:
    return web.json_response(request.app[HISTORY].snapshot())


async def openapi(request: web.Request) -> web.Response:
    models = request.app[MODELS]
    max_len = min((m.max_model_len for m in models.values() if isinstance(m, ModelRuntime)), default=2048)
    from .images import ImageModel
    from .videos import VideoModel
    videos = sorted(name for name, m in models.items() if isinstance(m, VideoModel))
    images = sorted(name for name, m in models.items() if isinstance(m, ImageModel))
    text = sorted(name for name, m in models.items() if isinstance(m, ModelRuntime))
    vocab = min((m.vocab_size for m in models.values() if isinstance(m, ModelRuntime)), default=None)
    return web.json_response(build_openapi(max_len, text, videos, image_models=images,
                                           speech=_speech_doc(models), vocab_size=vocab))


def _speech_doc(models: dict) -> SpeechDoc | None:
    """The served speech models as the speech routes judge them (gateway/speech.py's own checks)."""
    from .speech import MAX_INPUT_CHARS, flac_available, has_speakers, voices
    speaking = sorted(name for name, m in models.items()
                      if isinstance(m, ModelRuntime) and "generate" in m.stages and has_speakers(m))
    if not speaking:
        return None
    tables = [voices(models[name]) for name in speaking]
    # A voice the document offers must suit every speech model it may be sent with.
    common = None if any(t is None for t in tables) else sorted(set.intersection(*(set(t) for t in tables)))
    formats = ["wav", "pcm"] + (["flac"] if flac_available() else [])
    return SpeechDoc(models=speaking, voices=common or None, formats=formats, max_input_chars=MAX_INPUT_CHARS)


async def metrics(request: web.Request) -> web.Response:
    registry = request.app[METRICS]
    status = await request.app[BUS].status(request.app[CONFIG].status_timeout_s)
    if status is not None:   # without the broker, the gateway's own figures are still worth serving
        registry.update_cluster(status)
    return web.Response(body=registry.render(), content_type="text/plain", charset="utf-8",
                        headers={"X-Broker-Reachable": "1" if status is not None else "0"})


async def cluster(request: web.Request) -> web.Response:
    status = await request.app[BUS].status(request.app[CONFIG].status_timeout_s)
    if status is None:
        raise Unavailable("broker did not answer", retry_after=1)
    return web.json_response({"workers": status.workers, "queued": status.queued, "broker": status.counters})
