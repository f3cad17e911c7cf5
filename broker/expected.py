"""Workers the broker dropped for silence and expects back, per (model, role), each for a bounded time.

A worker silent past the liveness period is dropped (``BrokerCore.tick``), but silence is not
death: a process stopped (SIGSTOP, a debugger), starved of CPU on a loaded host, or killed and being
restarted by its supervisor speaks again seconds later, and registers again. While a dropped worker
is *expected back*, a (model, role) left without a live worker is not ``unavailable``: its requests
are held in the role's queue (bounded as ever by ``max_queue_per_role``, failed at their deadline)
and dispatched when a worker of the role registers and grants credit. Each expectation lasts
``BrokerConfig.expect_back_s`` from the drop; a worker that leaves on purpose (``Unregister``) is not
expected back. When the last expectation of a role with no live worker lapses, the broker fails that
role's queue as ``unavailable`` (the gateway's own wait, ``--worker-wait``, decides what follows).

Bounded: one entry per dropped worker id, at most ``limit`` (the registry's bound), each gone when
its worker registers again or its time is up.
"""

from __future__ import annotations

import collections

Key = tuple[str, str]   # (model, role)


class ExpectedWorkers:
    """The expectations of one broker. Only :class:`~omnirelay.broker.core.BrokerCore` calls it:
    :meth:`expect` when its tick drops a silent worker, :meth:`returned` when a worker registers,
    :meth:`awaited` on admission and when a stage is queued, :meth:`expire` from every tick (O(entries)).
    ``window_s`` 0 expects nobody back: a silent drop then fails the role's queue at once, as before."""

    def __init__(self, window_s: float, limit: int):
        self.window_s = window_s
        self._limit = limit
        self._until: dict[str, tuple[Key, float]] = {}   # worker id → its role's key, expected until
        self._per_role: collections.Counter[Key] = collections.Counter()

    def __len__(self) -> int:
        return len(self._until)

    def expect(self, worker_id: str, key: Key, now: float) -> None:
        """``worker_id`` of ``key`` was dropped for silence at ``now``: expect it back for the window."""
        if self.window_s <= 0 or (worker_id not in self._until and len(self._until) >= self._limit):
            return
        self.returned(worker_id)
        self._until[worker_id] = (key, now + self.window_s)
        self._per_role[key] += 1

    def returned(self, worker_id: str) -> None:
        """``worker_id`` registered again: nothing to wait for on its account."""
        entry = self._until.pop(worker_id, None)
        if entry is not None:
            self._forget(entry[0])

    def awaited(self, key: Key) -> bool:
        """Whether some worker of ``key`` is expected back."""
        return key in self._per_role

    def expire(self, now: float) -> list[Key]:
        """Forget the expectations whose time is up; returns the roles no worker is expected back to any more."""
        lapsed = [worker_id for worker_id, (_, until) in self._until.items() if until <= now]
        gone: list[Key] = []
        for worker_id in lapsed:
            key, _ = self._until.pop(worker_id)
            if self._forget(key):
                gone.append(key)
        return gone

    def _forget(self, key: Key) -> bool:
        self._per_role[key] -= 1
        if self._per_role[key] <= 0:
            del self._per_role[key]
            return True
        return False
