"""The speech role's record of a request it holds: one :class:`Delivery` per accepted attempt, with
a :class:`DeliveryStatus`, in the role's :class:`Deliveries` (the pattern of the engine's
requests.py, on the role's side of the bus).

Statuses a delivery passes::

    SYNTHESIZING ──the first streamed piece went out──▶ STREAMING ──its final piece──▶ (out)
    SYNTHESIZING ──the one-shot's audio went out / it failed / it was cancelled──▶ (out)

What it holds: the audio format the client asked for, the task's input hand-off (its keys are
deleted once the audio is out, the request failed or was cancelled: a retry after this worker's
death still finds them), the reply decode streams in (what it read decides which of decode's chunk
keys are left to delete), and the next MediaResult index of a streamed answer.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Iterator

from omnirelay.handoffs import Handoff

from omnirelay.workers.speech.reply_source import ReplySource


class DeliveryStatus(enum.Enum):
    SYNTHESIZING = "synthesizing"   # in the engine, nothing sent yet
    STREAMING = "streaming"         # streamed pieces on their way; ``next_index`` numbers the next


@dataclasses.dataclass(eq=False)
class Delivery:
    request_id: str
    format: str                              # wav | pcm | flac (SpeechParams.format)
    inputs: Handoff | None                   # released when the request leaves the worker
    reply: ReplySource | None = None         # a reply decode streams in (its unread chunks are deleted)
    status: DeliveryStatus = DeliveryStatus.SYNTHESIZING
    next_index: int = 0                      # streamed: the next MediaResult's index


class Deliveries:
    """The role's deliveries, by request id (one per id: a re-dispatch replaces the old attempt)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Delivery] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Delivery]:
        return iter(list(self._by_id.values()))

    def add(self, delivery: Delivery) -> None:
        if delivery.request_id in self._by_id:
            raise ValueError(f"request {delivery.request_id!r} is already held by this role")
        self._by_id[delivery.request_id] = delivery

    def get(self, request_id: str) -> Delivery | None:
        return self._by_id.get(request_id)

    def pop(self, request_id: str) -> Delivery | None:
        """``request_id``'s delivery, out of the role (None if it holds none)."""
        return self._by_id.pop(request_id, None)
