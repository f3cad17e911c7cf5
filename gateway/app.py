"""The aiohttp application, assembled: state under the typed keys (gateway/app_keys.py), the
middleware (gateway/middleware.py: errors, API key, per-request metrics and log) and the routes
(gateway/routes/).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (routes/completions.py, several
choices: routes/choices.py), ``/v1/responses`` (routes/responses.py), ``POST /tokenize`` and
``POST /detokenize`` (routes/tokenization.py), ``POST /v1/embeddings`` (routes/embeddings.py), ``/v1/rerank`` and ``/v1/score`` (routes/rerank.py), images (routes/images.py, routes/image_edits.py),
speech (routes/speech.py, routes/speech_ws.py, routes/voices.py), speech to text
(routes/transcriptions.py), ``/v1/realtime`` (routes/realtime.py), video jobs (routes/videos.py)
and the service's own (routes/service.py: models, health, cluster, metrics, status, OpenAPI;
gateway/server_load.py: ``/load``).

The bus client lives in a cleanup context, so it is started only if the app starts and closed
exactly once. Every error leaves as an OpenAI-style body ``{"error": {"message", "type", "param",
"code"}, "request_id", "stage"}`` with its status (gateway/error_answers.py).
"""

from __future__ import annotations

import collections

from aiohttp import web

from omnirelay.security import CurveKeys
from omnirelay.video_params import is_video_pipeline

from . import cpu_work, lora, server_load
from .app_keys import BUS, CONFIG, HISTORY, KEYS, METRICS, MODELS, SPOKEN_ANSWERS, STREAMS
from .bus import BusClient
from .config import GatewayConfig
from .metrics import GatewayMetrics
from .middleware import authenticate, errors, record_requests
from .models import ModelRuntime
from .routes.completions import add_completion_routes
from .routes.embeddings import add_embedding_routes
from .routes.rerank import add_rerank_routes
from .routes.image_edits import add_image_edit_routes
from .routes.images import ImageModel, add_image_routes, is_image_pipeline
from .routes.realtime import add_realtime_routes
from .routes.responses import add_response_routes
from .routes.service import add_service_routes
from .routes.speech import add_speech_routes
from .routes.speech_ws import add_speech_stream_routes
from .routes.tokenization import add_tokenize_routes
from .routes.transcriptions import add_transcription_routes
from .routes.videos import VideoModel, add_video_routes
from .routes.voices import add_voice_routes
from .spoken_answers import SpokenAnswers
from .status_page import StatusHistory


def create_app(config: GatewayConfig, keys: CurveKeys | None = None) -> web.Application:
    """``keys``: CURVE material for the bus (required when the broker or the token socket is off loopback)."""
    middlewares = [errors, authenticate, record_requests]
    if config.enable_server_load_tracking:   # innermost: a request refused for its API key never counts
        middlewares.append(server_load.track_load)
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    app[CONFIG] = config
    app[KEYS] = keys
    app[METRICS] = GatewayMetrics()
    app[STREAMS] = collections.Counter()
    app[SPOKEN_ANSWERS] = SpokenAnswers()   # spoken chat answers' transcripts, for later turns that name them
    app[MODELS] = {m.name: VideoModel(m) if is_video_pipeline(m.path) else ImageModel(m) if is_image_pipeline(m.path)
                   else ModelRuntime(m, config.media_limits(m.allowed_local_media_path),
                                     special_tokens_in_content=config.allow_special_tokens_in_content)
                   for m in config.models}
    lora.install(app, config.lora)   # adapters as models of their own names; nothing without --enable-lora
    cpu_work.install(app)   # request work too heavy for the event loop (gateway/cpu_work.py)
    app.cleanup_ctx.append(_bus_context)
    add_completion_routes(app)
    add_response_routes(app)
    add_tokenize_routes(app)
    add_embedding_routes(app)
    add_rerank_routes(app)
    add_image_routes(app)
    add_image_edit_routes(app)
    add_speech_routes(app)
    add_transcription_routes(app)
    add_speech_stream_routes(app)
    add_realtime_routes(app)
    add_voice_routes(app)
    add_video_routes(app)   # after the bus's cleanup context: its jobs are cancelled while the bus is open
    add_service_routes(app)
    server_load.install(app)   # GET /load (vLLM's; counts with --enable-server-load-tracking)
    return app


async def _bus_context(app: web.Application):
    config = app[CONFIG]
    bus = BusClient(config.broker, config.reply_host, app[KEYS], reply_port=config.reply_port,
                    worker_wait_s=config.worker_wait_s)
    await bus.start()
    app[BUS] = bus
    history = StatusHistory(bus, app[METRICS])
    history.start()
    app[HISTORY] = history
    yield
    await history.stop()
    await bus.close()
