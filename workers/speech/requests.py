"""The speech engines' request record: one :class:`SpeechRequest` per attempt a worker holds, whose
:class:`SpeechStatus` says where it is; the engine's :class:`SpeechRegistry` finds the live one
by request id in one lookup (the pattern of ``workers/llm/requests.py``).

Statuses a request passes::

    WAITING ──step(): a synthesis thread is free──▶ RUNNING ──its thread ended──▶ FINISHED / FAILED
    WAITING ──cancel / deadline──▶ (out: never started)
    RUNNING ──cancel──▶ CANCELLED (out of the registry at once; its thread stops at its next talker
                         step or chunk wait and is collected by step(), its result discarded)

The registry holds the requests that are not over. A cancelled running request leaves it at its
cancel, not when its thread ends: the broker may dispatch the same request id again to this worker
before that (a new attempt after a pause), and the new attempt is a new record — it never shares
the old one's event, its pieces or its fate. The engine keeps the cancelled records whose thread
still runs in its own list (:attr:`GenerateSpeechEngine.draining`) until step() collects them.

Per-request state lives here, on the record, never in an engine's side dict keyed by request id or
in a thread-local (the role adapter's is on its own record: delivery.py): the stop event its thread polls, whether its first streamed piece has left (a
vocoder's urgency), the codes behind that first piece (the engine's streamed-speech counters).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import threading
from typing import Any, Iterator


class SpeechStatus(enum.Enum):
    WAITING = "waiting"        # queued, no thread yet
    RUNNING = "running"        # on a synthesis thread
    CANCELLED = "cancelled"    # cancelled while RUNNING: its thread runs out, its result is dropped
    FINISHED = "finished"
    FAILED = "failed"


@dataclasses.dataclass(eq=False)   # compared by identity: a re-dispatched request id is another record
class SpeechRequest:
    """One attempt of one request in a speech engine. ``task`` is the family's (SpeechTask, TTSTask)."""

    task: Any
    status: SpeechStatus = SpeechStatus.WAITING
    future: concurrent.futures.Future | None = None   # its synthesis, while RUNNING or CANCELLED
    # Set by cancel: the talker stops at its next step, a wait for the thinker within one slice.
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    first_piece_codes: int | None = None   # streamed: codes spoken when its first piece left

    @property
    def request_id(self) -> str:
        return self.task.request_id

    @property
    def deadline(self) -> float:
        return self.task.deadline

    @property
    def priority(self) -> int:
        """The waiting queue's order (``Task.priority``, request_queue.py)."""
        return self.task.priority


class SpeechRegistry:
    """The engine's requests that are not over, by request id (one live attempt per id)."""

    def __init__(self) -> None:
        self._by_id: dict[str, SpeechRequest] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[SpeechRequest]:
        return iter(list(self._by_id.values()))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def add(self, request: SpeechRequest) -> None:
        if request.request_id in self._by_id:
            raise ValueError(f"request {request.request_id!r} is already held by this engine")
        self._by_id[request.request_id] = request

    def get(self, request_id: str) -> SpeechRequest | None:
        return self._by_id.get(request_id)

    def end(self, request: SpeechRequest, status: SpeechStatus) -> None:
        """``request`` is over for the worker (FINISHED, FAILED, CANCELLED): out of the registry."""
        request.status = status
        if self._by_id.get(request.request_id) is request:
            del self._by_id[request.request_id]

    def count(self, *statuses: SpeechStatus) -> int:
        return sum(r.status in statuses for r in self._by_id.values())
