"""The waiting line every role engine keeps: tasks in arrival order, taken out by request id when
cancelled and by deadline when expired. Written once here so the engines only say what a failure
looks like in their own result type.

Life of a task in the queue::

    add(task)                       joins the back (appendleft(task): the front, for a preempted sequence)
        ──cancel──▶ remove(request_id) / remove_all(request_id): taken out, returned to the engine
        ──deadline passed──▶ pop_expired(now): taken out, returned in order, for the engine to fail
        ──admitted──▶ popleft() / take_batch(limit, key) / remove_task(task): leaves for the engine's
                      running set (head shows the next one without taking it)

Order: arrival order, except that a task with a ``priority`` attribute (the bus Task's, non-zero
only under ``--scheduling-policy priority``) joins by :func:`~omnirelay.scheduling.queue_key` —
lower value first, FIFO among equals, aged by its wait so none starves (omnirelay/scheduling.py).
Under ``fcfs`` every priority is 0 and ``add`` appends, as before. ``appendleft`` goes ahead of all.

The queue holds no locks (its engine is driven from one thread), never fails a task itself and
never looks at anything but ``request_id`` (``deadline``, in :meth:`RequestQueue.pop_expired`, and
``priority`` when it has one).
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Generic, Hashable, Iterator, Protocol, TypeVar

from omnirelay.scheduling import queue_key


class Queued(Protocol):
    """What the queue needs of a task: the request it belongs to (several tasks may share one, e.g.
    the images of one image request)."""

    @property
    def request_id(self) -> str: ...


class Expiring(Queued, Protocol):
    """A task with a deadline: wall-clock seconds since the epoch, as on the bus."""

    @property
    def deadline(self) -> float: ...


T = TypeVar("T", bound=Queued)
E = TypeVar("E", bound=Expiring)


class RequestQueue(Generic[T]):
    """Waiting tasks in FIFO or priority order (see the module docstring)."""

    def __init__(self) -> None:
        self._tasks: collections.deque[T] = collections.deque()
        # Each task's queue_key, by id(task), while it waits (-inf: put at the front).
        self._keys: dict[int, float] = {}
        self.now: Callable[[], float] = time.monotonic   # the clock arrival times are read from

    def __len__(self) -> int:
        return len(self._tasks)

    def __bool__(self) -> bool:
        return bool(self._tasks)

    def __iter__(self) -> Iterator[T]:
        """Front to back. Do not add or take out while iterating (iterate over ``list(queue)``)."""
        return iter(self._tasks)

    def __repr__(self) -> str:
        return f"RequestQueue({[t.request_id for t in self._tasks]})"

    @property
    def head(self) -> T | None:
        """The task :meth:`popleft` would take, left in place; None when empty."""
        return self._tasks[0] if self._tasks else None

    def add(self, task: T) -> None:
        """Queue ``task`` behind every task whose key is not above its own (the back, under fcfs)."""
        key = queue_key(getattr(task, "priority", 0), self.now())
        tasks, keys = self._tasks, self._keys
        index = len(tasks)
        while index and keys.get(id(tasks[index - 1]), key) > key:   # short: from the back
            index -= 1
        tasks.insert(index, task)
        keys[id(task)] = key

    def appendleft(self, task: T) -> None:
        """Put ``task`` at the front: a preempted task goes before the ones that came after it."""
        self._tasks.appendleft(task)
        self._keys[id(task)] = float("-inf")

    def _left(self, task: T) -> T:
        self._keys.pop(id(task), None)
        return task

    def popleft(self) -> T:
        """Take the front task; IndexError when empty."""
        return self._left(self._tasks.popleft())

    def remove(self, request_id: str) -> T | None:
        """Take out the (first) task of ``request_id``; None when the queue holds none."""
        for index, task in enumerate(self._tasks):
            if task.request_id == request_id:
                del self._tasks[index]
                return self._left(task)
        return None

    def remove_all(self, request_id: str) -> list[T]:
        """Take out every task of ``request_id`` (in order); the others keep their order."""
        taken = [self._left(t) for t in self._tasks if t.request_id == request_id]
        if taken:
            self._tasks = collections.deque(t for t in self._tasks if t.request_id != request_id)
        return taken

    def remove_task(self, task: T) -> None:
        """Take out this very task (compared by identity, not equality); ValueError when absent."""
        for index, held in enumerate(self._tasks):
            if held is task:
                del self._tasks[index]
                self._left(task)
                return
        raise ValueError(f"task of request {task.request_id} is not waiting")

    def pop_expired(self: RequestQueue[E], now: float | None = None) -> list[E]:
        """Take out every task whose deadline is before ``now`` (default: the wall clock), in queue
        order; the others keep their order."""
        now = time.time() if now is None else now
        expired = [self._left(t) for t in self._tasks if now > t.deadline]
        if expired:
            self._tasks = collections.deque(t for t in self._tasks if not now > t.deadline)
        return expired

    def take_batch(self, limit: int, key: Callable[[T], Hashable]) -> list[T]:
        """Take the front task plus the next ones whose ``key`` equals its key, up to ``limit`` in
        all (the tasks that can run in one batch); the others keep their order. Empty when the
        queue is. ``key`` is not called once the batch is full."""
        if not self._tasks:
            return []
        head = self._left(self._tasks.popleft())
        wanted = key(head)
        batch, rest = [head], collections.deque()
        for task in self._tasks:
            if len(batch) < limit and key(task) == wanted:
                batch.append(self._left(task))
            else:
                rest.append(task)
        self._tasks = rest
        return batch

    def clear(self) -> None:
        self._tasks.clear()
        self._keys.clear()
