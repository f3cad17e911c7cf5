"""OpenTelemetry traces, one per request across every daemon (``--otlp-traces-endpoint URL``).

Off by default, and off costs nothing: without the flag no OpenTelemetry module is imported, the
daemons hold ``None`` instead of a :class:`Tracing`, and no bus message carries a ``traceparent``
(the field is left off the wire at its default, ``""``).

On, each daemon exports its spans over OTLP/HTTP (protobuf) to the URL, e.g.
``http://collector:4318/v1/traces``, in batches from the SDK's exporter thread. A trace is one
request; its tree::

    gateway  "POST /v1/chat/completions"        (route, model, status, tokens; an incoming
    │                                            ``traceparent`` header is its parent)
    └─ broker "broker request"                   (one per submission: a resumed stream is a second)
       ├─ "stage prefill"                        (queue wait, worker, attempt; from queued to reported)
       │  └─ worker "prefill"                    (from the task's arrival to its report)
       │     └─ "put shared_memory"              (each connector transfer: key, bytes, backend)
       └─ "stage decode"
          └─ worker "decode"
             └─ "get shared_memory"

The context travels as a W3C ``traceparent`` string: the gateway puts its span's in
``Submit.traceparent``, the broker puts each stage span's in ``Task.traceparent``. Sampling is
decided once, at the gateway (``--trace-sample-ratio``, or the client's sampled flag): an unsampled
request carries no ``traceparent``, so the broker and workers do nothing for it.

Ownership: a daemon makes its :class:`Tracing` at start-up and calls :meth:`Tracing.shutdown` on its
way out, which flushes the spans still queued and joins the exporter's thread.
"""

from __future__ import annotations

import argparse
import contextvars
import time
from typing import Any

# The traceparent of the span of the request being served in this context (an asyncio task's): the
# gateway sets it when it opens the request's record, and its bus client copies it into each Submit
# sent on the request's behalf. "" when the request is not traced.
CURRENT_TRACEPARENT: contextvars.ContextVar[str] = contextvars.ContextVar("omnirelay_traceparent", default="")


def add_tracing_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tracing (OpenTelemetry)")
    group.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="export a trace of each request over OTLP/HTTP to URL, e.g. "
                            "http://collector:4318/v1/traces (default: no tracing)")
    group.add_argument("--trace-sample-ratio", type=_ratio, default=1.0,
                       help="share of requests traced, 0 to 1 (decided at the gateway; a client's sampled "
                            "traceparent is always followed)")


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} must be between 0 and 1")
    return value


def tracing_from_args(service: str, args: argparse.Namespace) -> Tracing | None:
    """The daemon's tracer, or None when ``--otlp-traces-endpoint`` is not given."""
    if not args.otlp_traces_endpoint:
        return None
    return Tracing(service, args.otlp_traces_endpoint, args.trace_sample_ratio)


def tracing_argv(args: argparse.Namespace) -> list[str]:
    """The tracing flags of ``args`` as a launcher hands them on to each daemon it starts."""
    if not args.otlp_traces_endpoint:
        return []
    return ["--otlp-traces-endpoint", args.otlp_traces_endpoint, "--trace-sample-ratio", f"{args.trace_sample_ratio:g}"]


def now_ns() -> int:
    return time.time_ns()


class Tracing:
    """One daemon's tracer. Spans are the SDK's: callers set attributes, add events and ``end()``
    them; :meth:`start` and :meth:`traceparent` are the only ways in and out of a context."""

    def __init__(self, service: str, endpoint: str, ratio: float = 1.0):
        # Imported here: a daemon without tracing never loads OpenTelemetry.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": service}),
                                        sampler=ParentBased(TraceIdRatioBased(ratio)))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("omnirelay")
        self._propagator = TraceContextTextMapPropagator()
        self._set_span_in_context = set_span_in_context
        self._kinds = {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT,
                       "consumer": SpanKind.CONSUMER}

    def start(self, name: str, parent: Any = "", *, start_ns: int | None = None, kind: str = "internal",
              attributes: dict[str, Any] | None = None):
        """A started span, the child of ``parent``: a W3C traceparent string (a new trace if empty)
        or, within one process, the parent span itself (no text round trip)."""
        if isinstance(parent, str):
            context = self._propagator.extract({"traceparent": parent}) if parent else None
        else:
            context = self._set_span_in_context(parent)
        return self._tracer.start_span(name, context=context, kind=self._kinds[kind], attributes=attributes,
                                       start_time=start_ns)

    def traceparent(self, span) -> str:
        """``span``'s W3C traceparent, or "" when it is not sampled (nothing downstream then traces)."""
        if not span.get_span_context().trace_flags.sampled:
            return ""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._set_span_in_context(span))
        return carrier.get("traceparent", "")

    def flush(self, timeout_ms: int = 30_000) -> bool:
        """Export every span ended so far; blocks up to ``timeout_ms``. True when all went out."""
        return self._provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Export what is queued and stop the exporter's thread."""
        self._provider.shutdown()
