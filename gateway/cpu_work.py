"""The gateway's CPU pool: request work too heavy for the event loop (parsing a large body,
rendering a chat template and tokenizing a long prompt) runs here, so one request cannot freeze the
others' streams, ``/health`` or their small requests.

Sizes are bounded before the work (gateway/request_body.py, gateway/generation.py, the tool count in
gateway/structured.py); what is left runs on a few threads. Tokenizers (Rust) release the GIL while
they encode; Python-side work (JSON, Jinja) still shares it, but the event loop gets its turn every
switch interval instead of waiting for the whole job. Work submitted here must not mutate shared
state (a tokenizer's settings): several requests run it at once.

The pool belongs to the app (:func:`install` adds a cleanup context): it is shut down, its queued
jobs cancelled and its running ones joined, when the app stops. A request cancelled meanwhile (its
client gone) stops waiting at once; its job runs to its end, which the bounds keep short.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from aiohttp import web

T = TypeVar("T")
THREADS = 4
POOL: web.AppKey[ThreadPoolExecutor] = web.AppKey("cpu_pool", ThreadPoolExecutor)


def install(app: web.Application) -> None:
    """Give ``app`` its CPU pool for as long as it runs."""
    app.cleanup_ctx.append(_pool_context)


async def _pool_context(app: web.Application):
    pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="gateway-cpu")
    app[POOL] = pool
    try:
        yield
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


async def off_loop(app: web.Application, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the app's CPU pool; its result or its exception. An app without a
    pool (one built by a test without starting it) runs it inline."""
    pool = app.get(POOL)
    if pool is None:
        return fn(*args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))
