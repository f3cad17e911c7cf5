"""vLLM's ``GET /load``: ``{"server_load": N}``, the generation requests this gateway has in flight,
for a load balancer that routes to the least loaded server.

As vLLM 0.32: the route is always there, and counts only with ``--enable-server-load-tracking``
(without it, 0). A request counts from the moment its handler starts until its answer is written
in full — a stream until its ``[DONE]`` — whether it succeeds or fails. The routes counted are those
vLLM counts that this gateway serves (chat, completions, Responses, transcriptions and
translations) and the ones of its own that run a generation (speech, images, synchronous video);
not the probes, tokenizer routes, WebSocket sessions or asynchronous video jobs (``POST /v1/videos``
answers at once; its job runs on, visible on ``GET /v1/videos/{id}``).
"""

from __future__ import annotations

import dataclasses

from aiohttp import web

from .app_keys import SERVER_LOAD

COUNTED = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/audio/transcriptions",
    "/v1/audio/translations", "/v1/audio/speech", "/v1/images/generations", "/v1/images/edits",
    "/v1/videos/sync"})


@dataclasses.dataclass
class ServerLoad:
    """The count ``/load`` reports; only :func:`track_load` changes it."""

    in_flight: int = 0


@web.middleware
async def track_load(request: web.Request, handler):
    """Count a ``POST`` to a :data:`COUNTED` route while its handler runs (installed only with
    ``--enable-server-load-tracking``). Inside the API-key check: a refused request never counts."""
    if request.method != "POST" or request.path not in COUNTED:
        return await handler(request)
    load = request.app[SERVER_LOAD]
    load.in_flight += 1
    try:
        return await handler(request)
    finally:
        load.in_flight -= 1


async def server_load(request: web.Request) -> web.Response:
    return web.json_response({"server_load": request.app[SERVER_LOAD].in_flight})


def install(app: web.Application) -> None:
    """``GET /load`` and its count (the middleware is :func:`track_load`, which app.py adds with the flag)."""
    app[SERVER_LOAD] = ServerLoad()
    app.router.add_get("/load", server_load)
