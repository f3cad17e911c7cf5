"""A worker's spans of traced requests (``omni-worker --otlp-traces-endpoint``): one per task, the
child of the broker's stage span whose context the task carries (``Task.traceparent``), from the
task's arrival until the worker reports it (``StageDone`` or ``StageFailed``) or drops it on a
``CancelTask``. Attributes: ``worker_id``, ``stage``, ``attempt``, ``prompt_tokens``,
``position_offset``; a failure sets the span's error status and ``error_type``.

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

    def task_started(self, task: p.Task) -> None:
        old = self._spans.pop(task.request_id, None)
        if old is not None:   # sent again (a new attempt replaces the held one)
            old.add_event("replaced by attempt %d" % task.attempt)
            old.end()
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
        span.end()

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
            span.end()

    def close(self) -> None:
        for span in self._spans.values():
            span.add_event("worker stopped")
            span.end()
        self._spans.clear()
