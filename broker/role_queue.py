"""A (model, role) queue of request ids ordered by priority (``--scheduling-policy priority``).

The broker keeps a plain ``collections.deque`` per (model, role) under ``fcfs``; under ``priority``
it keeps a :class:`PriorityRoleQueue`, which answers the same calls the broker makes of a deque
(``append``, ``appendleft``, ``popleft``, ``remove``, ``in``, ``len``, iteration in order) but pops
the lowest :func:`~omnirelay.scheduling.queue_key` first: the request's priority, aged by the time
it has waited (the rule is in omnirelay/scheduling.py). ``appendleft`` keeps its deque meaning — a
request that was admitted before everything queued now (restarted after a lost worker or a failed
transfer) goes ahead of all of them.

A heap of (front, key, seq, request_id) with lazy removal: ``remove`` forgets the id and its heap
entry is dropped when it reaches the top, so every call is O(log n) but ``remove`` (O(1)) and
iteration (a sort, for the rare callers that walk the queue).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterator

from omnirelay.scheduling import queue_key


class PriorityRoleQueue:
    """Request ids, lowest aged priority first. ``priority_of(request_id)`` and ``now()`` are read
    when an id joins (the broker's request table and the time of the event being handled)."""

    def __init__(self, priority_of: Callable[[str], int], now: Callable[[], float]):
        self._priority_of, self._now = priority_of, now
        self._heap: list[tuple[int, float, int, str]] = []
        self._live: dict[str, int] = {}     # request id → seq of its current entry
        self._seq = itertools.count()
        self._front = itertools.count(-1, -1)   # appendleft: the latest goes first, as a deque's

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def __iter__(self) -> Iterator[str]:
        """The ids in the order they would be popped."""
        return iter([e[3] for e in sorted(self._heap) if self._live.get(e[3]) == e[2]])

    def append(self, request_id: str) -> None:
        seq = next(self._seq)
        self._live[request_id] = seq
        heapq.heappush(self._heap, (1, queue_key(self._priority_of(request_id), self._now()), seq, request_id))

    def appendleft(self, request_id: str) -> None:
        seq = next(self._seq)
        self._live[request_id] = seq
        heapq.heappush(self._heap, (0, float(next(self._front)), seq, request_id))

    def popleft(self) -> str:
        """The first id; IndexError when empty."""
        heap, live = self._heap, self._live
        while heap:
            _, _, seq, request_id = heapq.heappop(heap)
            if live.get(request_id) == seq:
                del live[request_id]
                return request_id
        raise IndexError("pop from an empty queue")

    def remove(self, request_id: str) -> None:
        """Take ``request_id`` out; ValueError when it is not queued (as a deque's)."""
        if self._live.pop(request_id, None) is None:
            raise ValueError(f"{request_id} is not queued")
        if len(self._heap) > 2 * len(self._live) + 64:   # stale entries outnumber live ones: compact
            self._heap = [e for e in self._heap if self._live.get(e[3]) == e[2]]
            heapq.heapify(self._heap)
