"""A worker's spans of traced requests (``omni-worker --otlp-traces-endpoint``): one per task, the
child of the broker's stage span whose context the task carries (``Task.traceparent``), from the
task's arrival until the worker reports it (``StageDone`` or ``StageFailed``) or drops it on a
``CancelTask``. Attributes: ``worker_id``, ``stage``, ``attempt``, ``prompt_tokens``,
``position_offset``; a failure sets the span's error status and ``error_type``.

Engine steps: a traced request's span counts the steps that produced something for it (tokens, a
report, a media item) as ``steps``, with ``batch_size_mean`` and ``batch_size_max``, the number of
requests each of those steps produced for (the batch as its outputs show it; a prefill chunk that
yields nothing yet is not seen), and marks its first such step with an event ``first output`` (the
time before it is the request's wait in the engine's queue plus its first step).

Each media item or chunk pushed to the gateway (``MediaResult``: an image, a spoken answer's audio
chunks) is an event ``chunk`` on the span (``index``, ``bytes`` of its base64 text, ``mime``, ``finish``).

Each connector transfer of a traced request is a child span, ``put BACKEND`` or ``get BACKEND``
(``key``, ``bytes``, ``backend``; error status when it failed), reported by the worker's
:class:`~omnirelay.connectors.timing.TimedConnector` once it ends. The request is read from the key,
whose second part names it in every hand-off key (``kv/REQ/ATTEMPT``, ``mm/REQ/ATTEMPT``,
``speech/REQ/…``); a transfer of a request without an open span is not traced.

The runtime's loop thread calls every method but :meth:`WorkerTracer.transfer`, which runs on the
thread of the transfer (it only reads the span table, which the loop alone changes); the loop calls
:meth:`WorkerTracer.close` when it stops, which ends what is still open. Untraced tasks (no
``traceparent``) never reach this module.
"""

from __future__ import annotations

from omnirelay.broker import protocol as p
from omnirelay.tracing import Tracing, now_ns


class WorkerTracer:
    def __init__(self, tracing: Tracing, role: str, worker_id: str):
        self._tracing = tracing
        self._role = role
        self._worker_id = worker_id
        self._spans: dict[str, object] = {}   # request_id → the open span of its task
        self._steps: dict[str, list[int]] = {}  # request_id → [steps, batch sizes summed, largest batch]

    def stepped(self, out: list) -> None:
        """One engine step's outputs (the loop calls this before sending them)."""
        if not self._spans:
            return
        produced = set()
        for _, msg in out:
            if isinstance(msg, p.TokenDeltas):
                produced.update(delta.request_id for delta in msg.deltas)
            elif isinstance(msg, (p.TokenDelta, p.StageDone, p.StageFailed, p.StageStreaming, p.MediaResult)):
                produced.add(msg.request_id)
        batch = len(produced)
        for request_id in produced:
            span = self._spans.get(request_id)
            if span is None:
                continue
            counts = self._steps.get(request_id)
            if counts is None:
                span.add_event("first output", {"batch_size": batch})
                counts = self._steps[request_id] = [0, 0, 0]   # steps, batch sizes summed, largest
            counts[0] += 1
            counts[1] += batch
            counts[2] = max(counts[2], batch)

    def _end(self, request_id: str, span) -> None:
        counts = self._steps.pop(request_id, None)
        if counts is not None:
            span.set_attribute("steps", counts[0])
            span.set_attribute("batch_size_mean", counts[1] / counts[0])
            span.set_attribute("batch_size_max", counts[2])
        span.end()

    def task_started(self, task: p.Task) -> None:
        old = self._spans.pop(task.request_id, None)
        if old is not None:   # sent again (a new attempt replaces the held one)
            old.add_event("replaced by attempt %d" % task.attempt)
            self._end(task.request_id, old)
        self._spans[task.request_id] = self._tracing.start(
            self._role, task.traceparent, start_ns=now_ns(), kind="consumer",
            attributes={"worker_id": self._worker_id, "stage": task.stage, "attempt": task.attempt,
                        "prompt_tokens": len(task.prompt_token_ids), "position_offset": task.position_offset})

    def reported(self, msg: p.StageDone | p.StageFailed) -> None:
        span = self._spans.pop(msg.request_id, None)
        if span is None:
            return
        if isinstance(msg, p.StageFailed):
            from opentelemetry.trace import Status, StatusCode   # loaded: tracing is on
            span.set_attribute("error_type", msg.error_type)
            span.set_status(Status(StatusCode.ERROR, f"{msg.error_type}: {msg.message}"[:200]))
        self._end(msg.request_id, span)

    def pushed(self, msg: p.MediaResult) -> None:
        span = self._spans.get(msg.request_id)
        if span is not None:
            span.add_event("chunk", {"index": msg.index, "bytes": len(msg.data), "mime": msg.mime,
                                     "finish": msg.finish})

    def transfer_watcher(self, backend: str):
        """The watcher to give the connector named ``backend`` (``TimedConnector.watch``)."""
        def watcher(op: str, key: str, nbytes: int, start_ns: int, end_ns: int, error: str) -> None:
            self.transfer(backend, op, key, nbytes, start_ns, end_ns, error)
        return watcher

    def transfer(self, backend: str, op: str, key: str, nbytes: int, start_ns: int, end_ns: int, error: str) -> None:
        parts = key.split("/", 2)
        parent = self._spans.get(parts[1]) if len(parts) > 1 else None
        if parent is None:
            return
        span = self._tracing.start(f"{op} {backend}", parent, start_ns=start_ns,
                                   attributes={"key": key, "bytes": nbytes, "backend": backend})
        if error:
            from opentelemetry.trace import Status, StatusCode   # loaded: tracing is on
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end_ns)

    def cancelled(self, request_id: str) -> None:
        span = self._spans.pop(request_id, None)
        if span is not None:
            span.add_event("cancelled")
            self._end(request_id, span)

    def close(self) -> None:
        for request_id, span in list(self._spans.items()):
            span.add_event("worker stopped")
            self._end(request_id, span)
        self._spans.clear()
