"""What the worker runtime needs of a role's engine, and what an engine may offer beyond it.

Every role's engine (prefill, decode, encode, image, video, speech) is driven the same way by its
role adapter (:mod:`.roles` and the roles' own modules) and by the runtime's loop (:mod:`.loop`)::

    add(task)            a task the adapter built from a bus Task; the engine queues it
    step()               one unit of work (a batch's forward, a denoising step, a talker chunk);
                         returns what finished or streamed, in the engine's own result type
    cancel(request_id)   drop the request wherever it is (queued, running, transferring)
    has_work             whether step() has anything to do (the loop waits on the broker otherwise)
    num_requests         requests held, queued or running (the loop grants credits up to capacity)
    wake()               end an idle wait inside step() now (called from another thread: the broker
                         link, when a message for the loop arrives); a no-op for engines that never wait
    close()              stop the engine's threads and what it runs beyond this process (transfer
                         threads, a synthesis thread, a sequence-parallel group's ranks); the
                         runtime calls it once it stops stepping, before it closes the connector
                         and the rest the role's builder hands it (``BuiltRole.owned``); idempotent

What the engines share is written once: the waiting line, with cancel by request id and expiry by
deadline, is a :class:`~omnirelay.workers.runtime.request_queue.RequestQueue`; every engine reports a
request it fails as a :class:`RequestFailure` in its step's result (beside its own success type).

Optional abilities are declared by the role adapter, not discovered by type: a role whose engine
keeps an automatic prefix cache sets :attr:`RoleAdapter.prefix_cache` to a :class:`PrefixCacheSource`
and the loop reports its blocks in heartbeats (prefix-aware routing); any other role leaves it None.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Engine(Protocol):
    @property
    def has_work(self) -> bool: ...

    @property
    def num_requests(self) -> int: ...

    def add(self, task: Any) -> None: ...

    def step(self) -> Any: ...

    def cancel(self, request_id: str) -> object: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class RequestFailure:
    """A request an engine's step() failed (past its deadline, out of memory, a bad input, a bug),
    in the same shape in every engine's result: the role adapter reports it as the stage's failure.
    ``error_type`` is an error class's (``DeadlineExceeded.error_type``, …; :mod:`omnirelay.errors`)."""

    request_id: str
    error_type: str
    message: str


@runtime_checkable
class PrefixCacheSource(Protocol):
    """An engine's content-named KV blocks, as the broker's prefix index wants them."""

    block_size: int

    def prefix_events(self) -> tuple[list[bytes], list[bytes]]:
        """Block names cached and evicted since the last call."""
        ...

    def prefix_names(self) -> list[bytes]:
        """Every block name cached now, oldest first."""
        ...
