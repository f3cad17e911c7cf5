"""The routes about the service itself: ``GET /v1/models``, ``GET /v1/models/{id}`` (one card; 404
naming an unknown id), ``GET /health`` (200 only while every role each model needs has a live
worker; ``GET``/``POST /ping`` is the same probe under the name vLLM and SageMaker use),
``GET /version`` (``{"version"}``: this package's), ``GET /cluster`` (the broker's view: workers, load,
counters, and ``settled``: nothing in flight and every worker's stats final), ``GET /metrics`` (Prometheus), ``GET /status`` (a live page), ``GET /status.json`` and
``GET /openapi.json``."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _package_version

from aiohttp import web

from omnirelay.errors import NotFound, Unavailable

from ..app_keys import BUS, CONFIG, HISTORY, METRICS, MODELS
from ..models import ModelRuntime
from ..openapi import SpeechDoc, build_openapi
from ..status_page import STATUS_HTML
from .images import ImageModel
from .speech import MAX_INPUT_CHARS, flac_available, has_speakers, voices
from .videos import VideoModel


try:
    _VERSION = _package_version("omnirelay")
except PackageNotFoundError:   # run from a source tree that was never installed
    _VERSION = "unknown"


def add_service_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)   # served names may hold slashes (org/name)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/cluster", cluster)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/status", status_page)
    app.router.add_get("/status.json", status_json)


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [m.card() for m in request.app[MODELS].values()]})


async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    model = request.app[MODELS].get(name)
    if model is None:
        raise NotFound(f"model {name!r} does not exist; see GET /v1/models", param="model")
    return web.json_response(model.card())


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": _VERSION})


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
    missing = {name: sorted(set(m.stages) - live.get(getattr(m, "base_name", name), set()))
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
    videos = sorted(name for name, m in models.items() if isinstance(m, VideoModel))
    images = sorted(name for name, m in models.items() if isinstance(m, ImageModel))
    text = sorted(name for name, m in models.items() if isinstance(m, ModelRuntime))
    vocab = min((m.vocab_size for m in models.values() if isinstance(m, ModelRuntime)), default=None)
    hearing = sorted(name for name, m in models.items() if isinstance(m, ModelRuntime) and m.media is not None)
    return web.json_response(build_openapi(max_len, text, videos, image_models=images,
                                           speech=_speech_doc(models), vocab_size=vocab, hearing_models=hearing))


def _speech_doc(models: dict) -> SpeechDoc | None:
    """The served speech models as the speech routes judge them (gateway/routes/speech.py's own checks)."""
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
    # settled: no request in flight and every worker's stats final (p.StatusReply) — fresh figures.
    return web.json_response({"workers": status.workers, "queued": status.queued, "broker": status.counters,
                              "requests": status.requests, "settled": not status.requests and not status.unsettled})
