"""The gateway's aiohttp middleware, outermost first: :func:`errors` (every failure leaves as the
error contract's body, gateway/error_answers.py), :func:`authenticate` (the API key), and
:func:`record_requests` (each request's metrics and log line, gateway/request_record.py).

With an API key configured, every ``/v1`` route and the tokenizer routes need ``Authorization:
Bearer <key>`` (compared in constant time); the probes (/health, /load, /metrics, /cluster, /status) stay
open unless ``protect_probes``.
"""

from __future__ import annotations

import hmac
import logging

from aiohttp import web

from omnirelay.errors import NotFound, OmniError, PayloadTooLarge, Unauthorized

from .app_keys import CONFIG
from .error_answers import error_response
from .request_body import RequestTimeout
from .request_record import finish_record

log = logging.getLogger("omnirelay.gateway")

PROBES = ("/health", "/ping", "/version", "/load", "/metrics", "/cluster", "/status", "/status.json")
TOKENIZER_ROUTES = ("/tokenize", "/detokenize")   # vLLM's paths, outside /v1; they cost CPU, so keyed too
SCORING_ROUTES = ("/rerank", "/v2/rerank", "/score")   # vLLM's too; they run the model


class MethodNotAllowed(OmniError):
    error_type, status, openai_type = "method_not_allowed", 405, "invalid_request_error"


@web.middleware
async def errors(request: web.Request, handler):
    try:
        return await handler(request)
    except RequestTimeout as exc:
        return await _answer_and_close(request, exc)
    except OmniError as exc:
        return error_response(exc)
    except web.HTTPRequestEntityTooLarge:
        return error_response(PayloadTooLarge(f"request body exceeds {request.app[CONFIG].max_body_bytes} bytes"))
    except web.HTTPNotFound:
        return error_response(NotFound(f"no route {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed:
        return error_response(MethodNotAllowed(f"{request.method} is not allowed on {request.path}"))
    except (web.HTTPException, ConnectionResetError):   # the latter: the client is gone, nobody to answer
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(OmniError("internal server error"))


async def _answer_and_close(request: web.Request, error: OmniError) -> web.StreamResponse:
    """Send ``error`` and close the connection at once. Without the close, aiohttp would go on
    reading (and discarding) the rest of a body the client still dribbles, for its lingering time."""
    response = error_response(error)
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()   # the answer is already in the socket; close() flushes it first
    return response


@web.middleware
async def authenticate(request: web.Request, handler):
    config = request.app[CONFIG]
    if config.api_key and (request.path.startswith("/v1/") or request.path in TOKENIZER_ROUTES + SCORING_ROUTES
                           or (config.protect_probes and request.path in PROBES)):
        supplied = request.headers.get("Authorization", "")
        expected = f"Bearer {config.api_key}"
        if not hmac.compare_digest(supplied.encode(), expected.encode()):
            raise Unauthorized("missing or invalid API key (Authorization: Bearer …)")
    return await handler(request)


@web.middleware
async def record_requests(request: web.Request, handler):
    """Finish the record a handler opened (gateway/request_record.py), however the handler ends.
    Inside :func:`errors`, so a raised error is counted (and given the request id) before it is
    rendered."""
    try:
        response = await handler(request)
    except BaseException as exc:
        finish_record(request, exc)
        raise
    finish_record(request, None)
    return response
