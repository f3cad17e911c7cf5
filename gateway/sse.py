"""The writer of one Server-Sent-Events answer (chat and completion streams, one choice or several),
and the per-client bound on open streams (``max_streams_per_client``) every such stream is held under.

Every write waits for the client for at most ``stream_write_timeout_s``: a client that stops reading
gets ConnectionResetError, so its worker slot and KV go back instead of waiting on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import msgspec
from aiohttp import web

from omnirelay.errors import OmniError, Overloaded

from .app_keys import CONFIG, STREAMS

# Compiled JSON encoding for the per-token chunks: about 5x cheaper than json.dumps.
_encode_json = msgspec.json.Encoder().encode


class SseWriter:
    """``data:`` events of chunks built on ``base`` (id, created, model, object) to ``response``. A
    chunk carries ``usage`` only when given one (gateway/usage.py says when: vLLM's chunks leave the
    key out otherwise)."""

    def __init__(self, response: web.StreamResponse, base: dict, write_timeout_s: float):
        self.response = response
        self.base = base
        self.write_timeout_s = write_timeout_s

    async def write(self, data: bytes) -> None:
        try:
            # asyncio.timeout, not wait_for: no task is created per write (one per token per stream).
            async with asyncio.timeout(self.write_timeout_s):
                await self.response.write(data)
        except TimeoutError:
            raise ConnectionResetError(f"client did not read for {self.write_timeout_s:.0f}s") from None

    async def send(self, choices: list, usage: dict | None = None, extra: dict | None = None) -> None:
        """One chunk; ``extra``: top-level fields of this chunk only (chat's ``prompt_token_ids`` on the first)."""
        payload = {**self.base, "choices": choices, **(extra or {})}
        if usage is not None:
            payload["usage"] = usage
        await self.write(b"data: " + _encode_json(payload) + b"\n\n")

    async def send_error(self, error: OmniError) -> None:
        """Headers are gone: the error travels as the last event, in the error contract's body."""
        await self.write(b"data: " + json.dumps(error.to_body()).encode() + b"\n\n")


@contextlib.contextmanager
def stream_slot(request: web.Request):
    """One of the client's ``max_streams_per_client`` streams; 429 when it holds them all."""
    config, streams, client = request.app[CONFIG], request.app[STREAMS], request.remote or "?"
    if streams[client] >= config.max_streams_per_client:
        raise Overloaded(f"client {client} already holds {streams[client]} streams", retry_after=1)
    streams[client] += 1
    try:
        yield
    finally:
        streams[client] -= 1
        if not streams[client]:
            del streams[client]
