"""The gateway's per-request record (gateway/request_record.py) through its middleware, over a real
aiohttp server: a route opens a record, the middleware writes the metrics and the log line once,
whether the handler answers, raises an OmniError, fails after its headers left, or crashes."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from omnirelay.errors import WorkerLost
from omnirelay.gateway.app_keys import CONFIG, METRICS
from omnirelay.gateway.config import GatewayConfig, ServedModel
from omnirelay.gateway.metrics import GatewayMetrics
from omnirelay.gateway.middleware import errors, record_requests
from omnirelay.gateway.request_record import Usage, open_record


async def _ok(request: web.Request) -> web.Response:
    record = open_record(request, "m", "req-ok", usage=Usage(prompt_tokens=5, completion_tokens=3), stages="decode")
    record.tokens(3)
    return web.json_response({"ok": True})


async def _raises(request: web.Request) -> web.Response:
    open_record(request, "m", "req-lost", stages="decode")
    raise WorkerLost("decode worker gone", stage="decode")


async def _fails_after_headers(request: web.Request) -> web.StreamResponse:
    record = open_record(request, "m", "req-late", stages="decode")
    response = web.StreamResponse()
    await response.prepare(request)
    record.failed(WorkerLost("decode worker gone", stage="decode"))
    await response.write(b"partial")
    return response


async def _crashes(request: web.Request) -> web.Response:
    open_record(request, "m", "req-bug", stages="decode")
    raise KeyError("a bug")


async def _serve(model_dir: str, paths: list[str]) -> tuple[GatewayMetrics, list[tuple[int, dict | str]]]:
    app = web.Application(middlewares=[errors, record_requests])
    app[CONFIG] = GatewayConfig(models=(ServedModel("m", model_dir),))
    app[METRICS] = metrics = GatewayMetrics()
    for path, handler in (("/ok", _ok), ("/raises", _raises), ("/late", _fails_after_headers), ("/bug", _crashes)):
        app.router.add_post(path, handler)
    answers = []
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        for path in paths:
            async with session.post(server.make_url(path), timeout=aiohttp.ClientTimeout(total=30)) as r:
                is_json = r.content_type == "application/json"
                answers.append((r.status, await r.json() if is_json else await r.text()))
    return metrics, answers


def _sample(metrics: GatewayMetrics, name: str, labels: dict) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_each_outcome_is_counted_once_and_logged(caplog, tmp_path):
    with caplog.at_level(logging.INFO, logger="omnirelay.gateway"):
        metrics, answers = asyncio.run(_serve(str(tmp_path), ["/ok", "/raises", "/late", "/bug"]))
    (ok_status, _), (lost_status, lost_body), (late_status, late_body), (bug_status, _) = answers
    assert (ok_status, lost_status, late_status, bug_status) == (200, 503, 200, 500)
    # A raised error leaves in the error contract's shape, carrying the record's request id.
    assert lost_body["error"]["code"] == "worker_lost" and lost_body["request_id"] == "req-lost"
    assert lost_body["stage"] == "decode" and late_body == "partial"

    requests = "omnirelay_requests_total"
    assert _sample(metrics, requests, {"model_name": "m", "outcome": "ok"}) == 1
    assert _sample(metrics, requests, {"model_name": "m", "outcome": "worker_lost"}) == 2   # raised, and late
    assert _sample(metrics, requests, {"model_name": "m", "outcome": "internal_error"}) == 1
    assert _sample(metrics, "omnirelay_request_errors_total", {"error_type": "worker_lost", "stage": "decode"}) == 2
    assert _sample(metrics, "vllm:prompt_tokens_total", {"model_name": "m"}) == 5
    assert _sample(metrics, "vllm:generation_tokens_total", {"model_name": "m"}) == 3
    assert _sample(metrics, "vllm:e2e_request_latency_seconds_count", {"model_name": "m"}) == 4

    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]
    assert len(lines) == 4
    ok_line = next(line for line in lines if line.startswith("request req-ok "))
    assert "model=m stages=decode prompt_tokens=5 completion_tokens=3 resumes=0 outcome=ok e2e=" in ok_line
    assert any(line.startswith("request req-late ") and "outcome=worker_lost" in line for line in lines)
