"""What every role adapter shares (:class:`RoleAdapter`): the bridge between bus messages and a
role's engine — ``Task`` in, ``TokenDelta``/``TokenDeltas``/``StageDone``/``StageFailed`` out. Each
role's adapter lives beside its engine (``workers/llm/roles.py``, ``workers/encode/role.py``, …); the
runtime treats them alike.

Each outgoing message is addressed either to :data:`BROKER` or to a gateway's ``reply_to``
endpoint, so the runtime knows which socket to use without looking inside. The runtime sends a
step's list in order, so a stage report placed after a token delta is sent after it.
"""

from __future__ import annotations

from typing import Callable

from omnirelay.errors import BadRequest
from omnirelay.broker import protocol as p
from omnirelay.handoffs import Handoff

from omnirelay.workers.runtime.engine import Engine, PrefixCacheSource

BROKER = ""
Outbound = tuple[str, p.Message]   # (BROKER or a reply_to endpoint, message)


class RoleAdapter:
    """What every role adapter shares: the engine it drives, the connector it reads and writes, and
    its bookkeeping of the requests it holds — the attempt of each task (echoed in its reports) and,
    for a role that answers the gateway itself, that gateway (``_reply_to``). A role with more
    per-request state extends :meth:`_forget`, which every way out of the worker goes through."""

    role = ""
    prefix_cache: PrefixCacheSource | None = None   # declared by a role whose engine keeps one

    def __init__(self, worker_id: str, engine: Engine, connector=None):
        """``connector``: the one this role reads its inputs from (and writes its outputs to), if any."""
        self.worker_id = worker_id
        self.engine = engine
        self.connector = connector
        self._attempts: dict[str, int] = {}   # request → attempt of the task we hold, echoed in reports
        self._reply_to: dict[str, str] = {}   # request → its gateway, for the roles that answer it here

    def release(self, handoff: Handoff | None) -> None:
        """Delete what ``handoff`` holds: a stage's output for a request that died before the next
        stage read it (``CancelTask.inputs``, sent to a consumer or back to the producer), or inputs
        this worker refuses. Any role's worker can: the hand-off names its keys."""
        if handoff is not None and self.connector is not None:
            handoff.release(self.connector)

    def cancel(self, request_id: str) -> object:
        """Drop the request in the engine and here; returns what the engine's ``cancel`` did."""
        dropped = self.engine.cancel(request_id)
        self._forget(request_id)
        self._attempts.pop(request_id, None)
        return dropped

    def held_loras(self) -> list[str] | None:
        """The LoRA adapters the worker holds, heartbeated for the broker's adapter affinity
        (:mod:`omnirelay.broker.lora_affinity`); None for a role or worker without LoRA."""
        return None

    def close_stream(self, request_id: str) -> None:
        """The consumer of a streamed hand-off this role writes for ``request_id`` finished first
        (``CancelTask.streams_only``): stop writing it. Roles that stream nothing ignore it."""

    def failure(self, request_id: str, stage: str, error_type: str, message: str,
                attempt: int | None = None) -> Outbound:
        """A StageFailed report for the broker (``attempt`` defaults to the held task's)."""
        held = self._attempts.pop(request_id, 0)
        return BROKER, p.StageFailed(self.worker_id, request_id, stage, error_type, message,
                                     attempt=held if attempt is None else attempt)

    def _hold(self, task: p.Task, *, reply_to: bool = True) -> None:
        """Remember a task the engine took: its attempt and (``reply_to``) its gateway."""
        self._attempts[task.request_id] = task.attempt
        if reply_to:
            self._reply_to[task.request_id] = task.reply_to

    def _forget(self, request_id: str) -> None:
        """Drop what this adapter keeps for a request besides its attempt (which its report pops)."""
        self._reply_to.pop(request_id, None)

    def _replace_held(self, task: p.Task) -> None:
        """The broker re-dispatched a request this worker still holds: the new attempt wins."""
        if task.request_id in self._attempts:
            self.cancel(task.request_id)

    def _queue(self, task: p.Task, what: str, engine_task: Callable[[], object]) -> list[Outbound]:
        """Queue ``engine_task()`` (which reads the task's parameters) and hold the request; parameters
        that do not parse, or that the engine refuses, fail it as ``bad_request`` ("invalid {what}: …")."""
        try:
            self.engine.add(engine_task())
        except (BadRequest, TypeError, ValueError) as exc:
            detail = exc.message if isinstance(exc, BadRequest) else str(exc)
            return [self.failure(task.request_id, task.stage, BadRequest.error_type, f"invalid {what}: {detail}",
                                 attempt=task.attempt)]
        self._hold(task)
        return []

    def _engine_failed(self, request_id: str, error_type: str, message: str) -> Outbound:
        """The report of a request the engine failed; this adapter forgets it."""
        self._forget(request_id)
        return self.failure(request_id, self.role, error_type, message)

    def _done(self, request_id: str, outputs: Handoff | None, finished: bool) -> Outbound:
        return BROKER, p.StageDone(self.worker_id, request_id, self.role, outputs, finished=finished,
                                   attempt=self._attempts.pop(request_id, 0))
