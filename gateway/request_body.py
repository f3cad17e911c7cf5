"""Reading a request's JSON body under the gateway's limits: a size bound (``max_body_bytes``, set
on the app) and one deadline for the whole body (``read_timeout_s``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from omnirelay.errors import BadRequest, OmniError, PayloadTooLarge

from .app_keys import CONFIG


class RequestTimeout(OmniError):
    """The body did not arrive within ``read_timeout_s``: the client is gone or too slow to serve.
    The error middleware answers it and closes the connection (gateway/middleware.py)."""

    error_type, status, openai_type = "request_timeout", 408, "invalid_request_error"


async def json_body(request: web.Request) -> Any:
    """The parsed JSON body; 413 over the size bound, 408 past the deadline, 400 if not JSON."""
    config = request.app[CONFIG]
    try:
        # One deadline for the whole body: a client sending it byte by byte cannot reset it.
        async with asyncio.timeout(config.read_timeout_s):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body exceeds {config.max_body_bytes} bytes") from None
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {config.read_timeout_s:g}s") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
