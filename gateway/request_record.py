"""One request's metrics and access-log line, written once however the request ends.

A route that serves a model opens a record (:func:`open_record`) as soon as it knows the model and
the request id; from then on the request is timed (``tokens`` per arriving chunk gives TTFT and
inter-token latency) and, when the handler returns or raises, the middleware
(gateway/middleware.py :func:`record_requests`) finishes it: ``omnirelay_gateway_requests_total
{model, outcome}``, end-to-end latency, prompt / generation tokens, resumes, the error counter
``{error_type, stage}`` for a failure, and one log line::

    request <id> model=<name> <route's fields> [prompt_tokens= completion_tokens= resumes=] outcome= e2e=

A video job outlives its HTTP request, so its task uses the record as a context manager instead.

Outcome: ``ok``; the error's ``error_type`` for an :class:`OmniError` (raised, or reported after
the headers left with :meth:`RequestRecord.failed`); ``cancelled`` when the client or the server
went away first; ``internal_error`` for a bug.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from aiohttp import web

from omnirelay.errors import Cancelled, OmniError
from omnirelay.tracing import CURRENT_TRACEPARENT

from .app_keys import CONFIG, METRICS, TRACING
from .metrics import GatewayMetrics

log = logging.getLogger("omnirelay.gateway")



@dataclasses.dataclass
class Usage:
    """Token counts for a request that is no :class:`~omnirelay.gateway.generation.Generation`."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    resumes: int = 0


class RequestRecord:
    """See the module docstring. ``usage``: anything with ``prompt_tokens``, ``completion_tokens``
    and ``resumes`` (a Generation, a choices Plan), read when the record finishes; ``log_usage``
    puts them on the log line. ``fields``: the route's own log fields, in order (updatable)."""

    def __init__(self, metrics: GatewayMetrics, model: str, request_id: str, *, log_requests: bool = True,
                 kind: str = "request", usage: Any = None, log_usage: bool = True, **fields: Any):
        self.metrics = metrics
        self.model = model
        self.request_id = request_id
        self.kind = kind
        self.usage = usage if usage is not None else Usage()
        self.log_usage = log_usage and usage is not None
        self.log_requests = log_requests
        self.fields = fields
        self.timer = metrics.timer(model)
        self._failure: OmniError | None = None
        self._finished = False
        self.span = None   # the request's trace span (open_record, with tracing on); ended by finish

    def tokens(self, count: int) -> None:
        self.timer.tokens(count)

    def failed(self, error: OmniError) -> None:
        """``error`` ended the request after its answer started (it travels in the body instead)."""
        error.request_id = error.request_id or self.request_id
        if self._failure is None:
            self._failure = error
            self.metrics.errors.labels(error.error_type, error.stage or "gateway").inc()

    def finish(self, raised: BaseException | None) -> None:
        """Write the metrics and the log line (once); ``raised``: what ended the handler, if anything."""
        if self._finished:
            return
        self._finished = True
        if isinstance(raised, OmniError):
            self.failed(raised)
        if self._failure is not None:
            outcome = self._failure.error_type
        elif raised is None:
            outcome = "ok"
        elif isinstance(raised, (asyncio.CancelledError, ConnectionResetError)):   # nobody left to answer
            outcome = Cancelled.error_type
        else:
            outcome = OmniError.error_type
        usage = self.usage
        self.timer.finish(usage.prompt_tokens, usage.completion_tokens, outcome, usage.resumes)
        if self.span is not None:
            _end_span(self.span, outcome, self._failure, usage)
        if self.log_requests:
            fields = dict(self.fields)
            if self.log_usage:
                fields.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                              resumes=usage.resumes)
            log.info("%s %s model=%s %s outcome=%s e2e=%.3fs", self.kind, self.request_id, self.model,
                     " ".join(f"{name}={value}" for name, value in fields.items()), outcome, self.timer.elapsed())

    def __enter__(self) -> RequestRecord:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(exc)


# The request's key for its open record (aiohttp >= 3.13 has typed request keys; older takes a string).
_RECORD = web.RequestKey("request_record", RequestRecord) if hasattr(web, "RequestKey") else "omnirelay.request_record"


def open_record(request: web.Request, model: str, request_id: str, **kwargs: Any) -> RequestRecord:
    """Start recording ``request`` (see :class:`RequestRecord` for ``kwargs``); the middleware
    finishes the record when the handler ends. With tracing on, the record opens the request's span
    (the child of the client's ``traceparent`` header, if any) and makes it the parent of what this
    task submits (``CURRENT_TRACEPARENT``, read by the bus client)."""
    app = request.app
    record = RequestRecord(app[METRICS], model, request_id, log_requests=not app[CONFIG].disable_log_requests,
                           **kwargs)
    request[_RECORD] = record
    tracing = app.get(TRACING)
    if tracing is not None:
        route = request.match_info.route.resource
        record.span = tracing.start(f"{request.method} {route.canonical if route else request.path}",
                                    request.headers.get("traceparent", ""), kind="server",
                                    attributes={"http.route": request.path, "model": model,
                                                "omnirelay.request_id": request_id})
        CURRENT_TRACEPARENT.set(tracing.traceparent(record.span))
    return record


def _end_span(span, outcome: str, failure: OmniError | None, usage: Any) -> None:
    span.set_attribute("outcome", outcome)
    if failure is not None or outcome == "ok":   # a client gone away or a bug has no status of ours
        span.set_attribute("http.status_code", failure.status if failure is not None else 200)
    span.set_attribute("prompt_tokens", usage.prompt_tokens)
    span.set_attribute("completion_tokens", usage.completion_tokens)
    span.set_attribute("resumes", usage.resumes)
    if outcome != "ok":
        from opentelemetry.trace import Status, StatusCode   # tracing is on: the SDK is loaded
        span.set_status(Status(StatusCode.ERROR, outcome))
    span.end()


def finish_record(request: web.Request, raised: BaseException | None) -> None:
    """The middleware's half: finish the record the handler opened, if it opened one."""
    record = request.get(_RECORD)
    if record is not None:
        record.finish(raised)
