"""Passes of load against one server: warm-up, then one measured pass per concurrency level.

The life of a benchmark: one HTTP session is opened; the warm-up requests run (not measured); then
for each concurrency level of the sweep (or the single ``max_concurrency``) every prompt is sent
once: requests are released one after another, at once or with exponential gaps (Poisson arrivals
at ``request_rate``), and each waits for a free slot when a concurrency limit is set. A pass ends
when every request has finished or failed; each request is bounded by ``timeout_s``, so a pass is
bounded too. Every request task belongs to the pass's task group, which joins them all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Callable

import aiohttp

from . import metrics
from .client import RequestResult, Target, send_request
from .datasets import Prompt
from .progress import ProgressBar


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How to load the server; validated on construction."""

    target: Target
    concurrencies: tuple[int | None, ...] = (None,)   # one pass per entry; None = no limit
    request_rate: float = math.inf                    # requests/s (Poisson); inf = all at once
    num_warmups: int = 0
    timeout_s: float = 600.0                          # per request, connect to last byte
    seed: int = 0
    slo: dict = dataclasses.field(default_factory=dict)   # goodput SLO, ms per metric
    progress: bool = True

    def __post_init__(self):
        if not self.concurrencies:
            raise ValueError("at least one pass is needed")
        if any(c is not None and c < 1 for c in self.concurrencies):
            raise ValueError("concurrency must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf sends every request at once)")
        if self.num_warmups < 0:
            raise ValueError("num_warmups must be >= 0")
        if not self.timeout_s > 0:
            raise ValueError("timeout must be > 0")


class BenchmarkError(RuntimeError):
    """The benchmark cannot run (no model listed, every warm-up request failed)."""


def new_session(timeout_s: float) -> aiohttp.ClientSession:
    # No pool limit: concurrency is limited by the pass, so the timeout never counts time spent
    # waiting for a pooled connection.
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 connector=aiohttp.TCPConnector(limit=0), trust_env=False)


async def discover_model(session: aiohttp.ClientSession, base_url: str, api_key: str | None = None) -> str:
    """The first model id that ``GET /v1/models`` lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers) as response:
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        raise BenchmarkError(f"cannot list models at {base_url}/v1/models: {exc}") from exc
    data = body.get("data") if isinstance(body, dict) else None
    if not data or not isinstance(data[0], dict) or not data[0].get("id"):
        raise BenchmarkError(f"{base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


async def run_pass(session: aiohttp.ClientSession, target: Target, prompts: list[Prompt],
                   max_concurrency: int | None, request_rate: float, seed: int,
                   on_done: Callable[[RequestResult], None] = lambda result: None,
                   ) -> tuple[list[RequestResult], float]:
    """Send every prompt once; the results in prompt order and the pass's wall time in seconds."""
    rng = random.Random(seed)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult] = [RequestResult(False, error="not sent")] * len(prompts)

    async def one(index: int, prompt: Prompt) -> None:
        if slots is None:
            result = await send_request(session, target, prompt)
        else:
            async with slots:
                result = await send_request(session, target, prompt)
        results[index] = result
        on_done(result)

    start = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for index, prompt in enumerate(prompts):
            group.create_task(one(index, prompt))
            if math.isfinite(request_rate) and index + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(request_rate))
    return results, time.perf_counter() - start


async def benchmark(config: RunConfig, prompts: list[Prompt]) -> list[dict]:
    """Warm up, then one summary (see :func:`metrics.summarize`) per concurrency level."""
    runs = []
    async with new_session(config.timeout_s) as session:
        if config.num_warmups:
            warm = [prompts[i % len(prompts)] for i in range(config.num_warmups)]
            limit = min(config.num_warmups, max((c or config.num_warmups) for c in config.concurrencies))
            results, _ = await run_pass(session, config.target, warm, limit, math.inf, config.seed)
            if not any(r.success for r in results):
                summary = "; ".join(f"{e['count']}x {e['error']}" for e in metrics.error_summary(results)[:3])
                raise BenchmarkError(f"every warm-up request failed: {summary}")
        for concurrency in config.concurrencies:
            label = f"c={concurrency} " if len(config.concurrencies) > 1 else ""
            bar = ProgressBar(len(prompts), label, enabled=config.progress)
            results, duration = await run_pass(session, config.target, prompts, concurrency,
                                               config.request_rate, config.seed,
                                               on_done=lambda result: bar.update(result.success))
            bar.close()
            run = {"max_concurrency": concurrency,
                   "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf"}
            run.update(metrics.summarize(results, duration, config.slo))
            runs.append(run)
    return runs
