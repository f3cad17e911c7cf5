"""The one shape a failed request has, wherever the gateway reports it.

An HTTP answer's body, and the last ``data:`` event of a chat or completion stream whose headers
are gone, are :meth:`OmniError.to_body`: OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` (``code``: our ``error_type``) plus ``request_id`` and ``stage``. An event in a stream of
typed events (speech SSE, the WebSocket routes) is the same body with ``"type": "error"`` and the
event's own context (an ``item_id``; inside ``error``, Realtime's ``event_id``) added.

Formats whose schema is someone else's keep it, built from the same error: a video job's
``error`` is OpenAI's ``{"code", "message"}``; a Realtime ``response.done``'s ``status_details``.
"""

from __future__ import annotations

import math

from aiohttp import web

from omnirelay.errors import OmniError


def error_response(error: OmniError) -> web.Response:
    """The HTTP answer for ``error``, with its status. Every recoverable error (429 overloaded, 503
    unavailable / worker lost, 502 transfer failed) tells the client when trying again makes sense;
    the others would fail the same way again."""
    if not error.recoverable:
        return web.json_response(error.to_body(), status=error.status)
    hint = error.retry_after if 0 < error.retry_after <= 3600 else 1   # a hint off the bus is not trusted blindly
    return web.json_response(error.to_body(), status=error.status, headers={"Retry-After": str(math.ceil(hint))})


def error_event(error: OmniError, **context) -> dict:
    """``error`` as one event of a typed event stream: ``{"type": "error", **context, **to_body}``."""
    return {"type": "error", **context, **error.to_body()}
