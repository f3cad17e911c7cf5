"""vLLM's ``GET /load`` (gateway/server_load.py) over a real aiohttp server with scripted handlers:
``{"server_load": N}`` counts the generation requests whose handlers are running — answered or
failed, each leaves the count — and nothing else (probes, tokenizer routes, other methods); a request
the API key refuses never counts; without ``--enable-server-load-tracking`` the route answers 0."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from omnirelay.errors import WorkerLost
from omnirelay.gateway import server_load
from omnirelay.gateway.app_keys import CONFIG
from omnirelay.gateway.config import GatewayConfig, ServedModel
from omnirelay.gateway.middleware import authenticate, errors


class _Held:
    """Handlers that hold their request until released: ``started`` is set once ``expected`` run."""

    def __init__(self, expected: int):
        self.expected, self.running = expected, 0
        self.started, self.release = asyncio.Event(), asyncio.Event()

    async def answer(self, request: web.Request) -> web.Response:
        await self._hold()
        return web.json_response({"ok": True})

    async def fail(self, request: web.Request) -> web.Response:
        await self._hold()
        raise WorkerLost("decode worker gone", stage="decode")

    async def _hold(self) -> None:
        self.running += 1
        if self.running == self.expected:
            self.started.set()
        await self.release.wait()


async def _scenario(tmp_path, tracking: bool) -> list:
    held = _Held(expected=3)
    app = web.Application(middlewares=[errors, authenticate, *([server_load.track_load] if tracking else [])])
    app[CONFIG] = GatewayConfig(models=(ServedModel("m", str(tmp_path)),), api_key="k",
                                enable_server_load_tracking=tracking)
    app.router.add_post("/v1/completions", held.answer)
    app.router.add_post("/v1/chat/completions", held.fail)
    app.router.add_post("/tokenize", held.answer)   # not a generation: never counted
    server_load.install(app)
    seen: list = []
    auth = {"Authorization": "Bearer k"}
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        async def load() -> int:
            async with session.get(server.make_url("/load")) as reply:
                assert reply.status == 200
                return (await reply.json())["server_load"]

        async def post(path: str, headers: dict) -> int:
            async with session.post(server.make_url(path), headers=headers) as reply:
                return reply.status

        seen.append(await load())
        assert await post("/v1/completions", {}) == 401   # refused before it could count
        seen.append(await load())
        requests = [asyncio.create_task(post(path, auth)) for path in ("/v1/completions", "/v1/chat/completions",
                                                                       "/tokenize")]
        await held.started.wait()
        seen.append(await load())
        held.release.set()
        seen.append(await asyncio.gather(*requests))
        seen.append(await load())
    return seen


def test_load_counts_the_generations_in_flight(tmp_path):
    assert asyncio.run(_scenario(tmp_path, tracking=True)) == [0, 0, 2, [200, 503, 200], 0]


def test_without_the_flag_load_answers_zero(tmp_path):
    assert asyncio.run(_scenario(tmp_path, tracking=False)) == [0, 0, 0, [200, 503, 200], 0]


def test_only_generation_routes_count():
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/audio/transcriptions",
            "/v1/audio/translations"} <= server_load.COUNTED   # those vLLM counts that this gateway serves
    assert not {"/tokenize", "/detokenize", "/health", "/load", "/v1/models", "/v1/videos"} & server_load.COUNTED
