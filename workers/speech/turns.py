"""Turns and slots: what the synthesis threads of one speech worker may not do all at the same time.

:class:`Turns`: one thread at a time, for a talker's prompt forward — the talker module keeps the
M-RoPE ``rope_deltas`` it computes there, one value for the module, and the forward reads it back
before letting go (``qwen2_5_talker.start`` …). Nothing here touches a random stream: every draw of
a request comes from its own ``torch.Generator`` (talker sampling, token2wav's noise), so no
process-global random state is set or read by any thread. Waiting threads are served in arrival
order, except that a streamed request (``hold(urgent=True)``) goes before the others: time to first
audio is what a listener waits for (the way a scheduler runs a new prompt's prefill first).

:class:`Slots` is the same line with room for more than one: for work that only competes for the
cores (the vocoders: engine.py ``VOCODER_SLOTS``).

The talker's decode steps are in neither: those run batched (step_batch.py).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Iterator


class Slots:
    """At most ``capacity`` threads inside at once; waiters are served in arrival order, urgent ones
    first."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._cond = threading.Condition()
        self._inside = 0
        self._queue: collections.deque[_Waiter] = collections.deque()

    @contextlib.contextmanager
    def hold(self, urgent: bool = False) -> Iterator[None]:
        me = _Waiter(urgent)
        with self._cond:
            self._queue.append(me)
            while self._inside >= self.capacity or \
                    next((w for w in self._queue if w.urgent), self._queue[0]) is not me:
                self._cond.wait()
            self._queue.remove(me)
            self._inside += 1
            self._cond.notify_all()   # the next in line may fit too
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                self._cond.notify_all()


class Turns(Slots):
    """The one turn of a worker's synthesis threads (a slot of one)."""

    def __init__(self):
        super().__init__(1)


class _Waiter:
    __slots__ = ("urgent",)

    def __init__(self, urgent: bool):
        self.urgent = urgent
