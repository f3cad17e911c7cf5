"""The broker's spans of a traced request (``omni-broker --otlp-traces-endpoint``), built from the
messages the daemon passes in and out; :class:`~omnirelay.broker.core.BrokerCore` knows nothing of
them beyond copying ``Submit.traceparent`` into each ``Task``.

Per submission (a request resumed after a failover is a new submission, so a second broker span
under the same gateway span)::

    "broker request"    from Submit until the request finishes, fails or is cancelled
    └─ "stage ROLE"     one per dispatch: from the moment the stage was queued (admission, or the
                        previous stage's report or streamed hand-off) until its worker reports (a
                        stage streaming into the next one stays open until its own report); ``queue_wait_s``,
                        ``worker_id``, ``attempt``; a stage dispatched again (its worker was lost,
                        a transfer failed and the request restarted) ends the old span with an
                        event saying so and opens another

The stage span's context replaces ``Task.traceparent``, so each worker's span is its child.

Hot path: the daemon calls :meth:`BrokerTracer.inbound` for each message and
:meth:`BrokerTracer.after_pass` for each batch of replies only when tracing is on; an untraced
request (no ``traceparent``) is one dictionary miss per message.
"""

from __future__ import annotations

import dataclasses

import msgspec

from omnirelay.tracing import Tracing, now_ns

from . import protocol as p
from .core import BrokerCore

# Traced requests the core forgot without a message we saw (a gateway given up): swept when the
# table outgrows the core's requests by this much.
SWEEP_SLACK = 1024


@dataclasses.dataclass(slots=True)
class _Traced:
    request: object                 # the broker span
    queued_ns: int                  # when the current stage was queued
    stage: object | None = None     # the open span of the current stage …
    stage_name: str = ""            # … and its stage
    producer: object | None = None  # the span of a stage streaming into the current one (StageStreaming) …
    producer_name: str = ""         # … until its own report


class BrokerTracer:
    def __init__(self, tracing: Tracing):
        self._tracing = tracing
        self._traced: dict[str, _Traced] = {}
        self._touched: set[str] = set()

    def inbound(self, msg: p.Message) -> None:
        """A message the core is about to handle."""
        if isinstance(msg, p.Submit):
            if msg.traceparent and msg.request_id not in self._traced:
                now = now_ns()
                span = self._tracing.start("broker request", msg.traceparent, start_ns=now, kind="consumer",
                                           attributes={"omnirelay.request_id": msg.request_id, "model": msg.model,
                                                       "stages": list(msg.stages),
                                                       "position_offset": msg.position_offset})
                if msg.position_offset:
                    span.add_event("resumed", {"position": msg.position_offset})
                self._traced[msg.request_id] = _Traced(span, now)
                self._touched.add(msg.request_id)
            return
        if not isinstance(msg, (p.StageDone, p.StageFailed, p.StageStreaming, p.Cancel)):
            return
        traced = self._traced.get(msg.request_id)
        if traced is None:
            return
        self._touched.add(msg.request_id)
        if isinstance(msg, p.Cancel):
            traced.request.add_event("cancelled", {"reason": msg.reason})
            return
        now = now_ns()
        if traced.producer is not None and msg.stage == traced.producer_name \
                and not isinstance(msg, p.StageStreaming):
            _end_stage(traced.producer, msg, now)   # the producer of a streamed hand-off finished writing
            traced.producer = None
            return
        if traced.stage is None or msg.stage != traced.stage_name:
            return   # a late report of another stage: the core ignores it too
        if isinstance(msg, p.StageStreaming):
            # Its successor starts now; the stage runs on as the producer until its own report.
            traced.stage.add_event("successor started on its streamed hand-off")
            traced.producer, traced.producer_name = traced.stage, traced.stage_name
        else:
            _end_stage(traced.stage, msg, now)
        traced.stage = None
        traced.queued_ns = now   # the next stage (or this one again, on a restart) waits from here

    def after_pass(self, out: list, core: BrokerCore) -> list:
        """The replies of one pass, with each traced Task's ``traceparent`` set to its stage span;
        ends the spans of requests that left the core."""
        traced_table = self._traced
        if traced_table:
            for i, (identity, msg) in enumerate(out):
                if isinstance(msg, p.Task):
                    traced = traced_table.get(msg.request_id)
                    if traced is not None:
                        out[i] = (identity, self._dispatched(traced, msg, core))
                elif isinstance(msg, p.RequestFailed):
                    traced = traced_table.get(msg.request_id)
                    if traced is not None:
                        traced.request.set_attribute("error_type", msg.error_type)
                        traced.request.set_attribute("resumable", msg.resumable)
                        traced.request.set_status(_error_status(msg.error_type, msg.message))
                        self._touched.add(msg.request_id)
        for request_id in self._touched:
            traced = traced_table.get(request_id)
            if traced is not None and request_id not in core.requests:
                self._end(request_id, traced)
        self._touched.clear()
        if len(traced_table) > len(core.requests) + SWEEP_SLACK:
            for request_id in [r for r in traced_table if r not in core.requests]:
                self._end(request_id, traced_table[request_id])
        return out

    def close(self) -> None:
        """End every open span (the broker is stopping)."""
        for request_id, traced in list(self._traced.items()):
            traced.request.add_event("broker stopped")
            self._end(request_id, traced)

    def _dispatched(self, traced: _Traced, task: p.Task, core: BrokerCore) -> p.Task:
        now = now_ns()
        if traced.stage is not None:   # dispatched again before its worker reported: that worker was lost
            traced.stage.add_event("dispatched again (worker lost)")
            traced.stage.set_status(_error_status("worker_lost", "dispatched again"))
            traced.stage.end(end_time=now)
        req = core.requests.get(task.request_id)
        worker_id = req.worker_id if req is not None else ""
        traced.stage_name = task.stage
        traced.stage = self._tracing.start(
            f"stage {task.stage}", traced.request, start_ns=traced.queued_ns,
            attributes={"stage": task.stage, "worker_id": worker_id or "", "attempt": task.attempt,
                        "queue_wait_s": (now - traced.queued_ns) / 1e9})
        return msgspec.structs.replace(task, traceparent=self._tracing.traceparent(traced.stage))

    def _end(self, request_id: str, traced: _Traced) -> None:
        now = now_ns()
        for span in (traced.stage, traced.producer):
            if span is not None:
                span.end(end_time=now)
        traced.request.end(end_time=now)
        del self._traced[request_id]


def _end_stage(span, msg: p.StageDone | p.StageFailed, now: int) -> None:
    if isinstance(msg, p.StageFailed):
        span.set_attribute("error_type", msg.error_type)
        span.set_status(_error_status(msg.error_type, msg.message))
    span.end(end_time=now)


def _error_status(error_type: str, message: str):
    from opentelemetry.trace import Status, StatusCode   # tracing is on: the SDK is loaded already
    return Status(StatusCode.ERROR, f"{error_type}: {message}"[:200])
