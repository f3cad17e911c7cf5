"""Connector transfers off the step thread: an engine's batch keeps stepping while data moves.

A connector call blocks: on a Redis outage, a slow link or a layerwise KV whose pieces trickle in, a
``get`` waits up to the transfer timeout and a ``put`` up to the store's socket timeout. Run on the
step thread it would stall every request of the worker. The LLM and encode engines hand their
transfers to a :class:`TransferPool` instead: decode its KV imports
(:mod:`~omnirelay.workers.kv.prefetch`) and its spoken replies' states, prefill its media-embedding
gets and its KV / prompt-state hand-offs (:mod:`~omnirelay.workers.llm.handoff_jobs`), encode its
embeddings (:mod:`~omnirelay.workers.encode.embeds_send`).
What moves and how to free it is the job's (:class:`TransferJob`); the pool owns the threads, the
states, the memory bound and the clean-up rules, written once for every kind of transfer.

Life of one transfer (:class:`Transfer`, made by :meth:`TransferPool.submit`)::

    QUEUED ──a thread is free and fewer than max_held transfers are held──▶ RUNNING: job.run
        ──▶ READY: the result held for the engine ──take()──▶ TAKEN: the engine owns the result
    RUNNING ──an OmniError (or any exception, as TransferFailed)──▶ job.discard(None), on the
        transfer thread ──▶ FAILED: the engine fails the request with the error's error_type
    cancel(): QUEUED → CANCELLED, job.discard(None) at once (on the caller's thread);
              RUNNING → CANCELLED, job.discard(result or None) when run returns (transfer thread);
              READY → CANCELLED, job.discard(result) (on the caller's thread)

The ownership rule every job relies on: from ``submit`` on, the transfer owns what the job moves
(the connector keys it reads, the memory and keys it writes) until the engine takes the result; a
transfer that does not end TAKEN is discarded exactly once, so a cancelled or failed request leaves
no key or reservation behind (best-effort: a store still down leaves them to their TTL). Failure
discards before the state changes, so a request reported failed has nothing left.

A transfer cannot be interrupted: a connector call in progress runs out its own timeout (the pool's
``timeout_s``, capped by the job's deadline, for gets). A cancelled one issues no further get: the
connector the job sees (:class:`_StopsWhenCancelled`) refuses it, so e.g. a layerwise KV import
deletes its remaining pieces unread.

Memory bound: at most ``max_held`` transfers are RUNNING or READY at once; further ones wait QUEUED.
The engines pass their batch size: what a READY result holds (a KV on the host, a media payload)
beyond one batch of admissions could not be used anyway.

Threads: at most ``threads`` (default 2; each backend's ``get`` and ``put`` are safe from several
threads at once, which the connector contract suite checks). A thread is started by ``submit`` (or
when a held transfer leaves) while startable transfers outnumber the free threads, and ends by
itself once none has been startable for :attr:`TransferPool.LINGER_S`: a busy engine reuses its
threads step after step instead of starting one per burst, and an idle pool holds no thread.

Inline writes: a job that only writes (``writes_only``: puts, publishes, deletes; no get that
waits for a key) on a connector that declares its writes local (``Connector.local_writes``: shared
memory) runs inside ``submit`` and returns READY or FAILED. Such a write cannot stall the step, and
on a thread it would only compete for the GIL it needs and add a hand-off per step (the serving A/B
of issue #18 measured it). It skips the queue and the ``max_held`` bound: its result is taken in the
same step. :meth:`TransferPool.close` (the engine's
``close``) cancels what is queued or in flight and joins every thread for at most
:attr:`TransferPool.CLOSE_JOIN_S`: a thread still inside a connector call then (a store outage) is
logged and left to finish it. Threads are daemon threads so that such a one does not hold up the
process's exit; when its call returns it only discards (any exception logged and swallowed: the
connector may have been closed meanwhile) and ends.

Releases (:meth:`TransferPool.release`): the keys of a request that went away (cancelled, failed,
refused) are deleted through the pool too, since a delete is a connector call like any other (on
Redis one can block for the socket timeout). Fire and forget: a release is a write-only job that
leaves no result to take; one still queued when the pool closes runs on close()'s release thread.

Scratch memory: a pool made with ``scratch`` keeps one such object per thread (decode's layerwise
assembly buffers); a running transfer borrows a free one and a READY result keeps it until taken.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from omnirelay.connectors import Connector, ConnectorWrapper
from omnirelay.connectors.base import DEFAULT_GET_TIMEOUT_S, Handle, Payload
from omnirelay.errors import OmniError, TransferFailed

log = logging.getLogger("omnirelay.worker.transfers")

Result = TypeVar("Result")
Result_co = TypeVar("Result_co", covariant=True)


class TransferJob(Protocol[Result]):
    """What one transfer moves. ``run`` executes on a transfer thread; ``discard`` frees what the
    job moved when nobody will take its result (see the ownership rule above); it must not raise
    for a store that is down (log and leave the keys to their TTL)."""

    name: str          # what moves, for logs and errors (a connector key)
    deadline: float    # the request's deadline (``time.time()`` clock): no get waits past it
    writes_only: bool  # run only puts, publishes and deletes (no get): inline on local connectors

    def run(self, connector: Connector, timeout: float, scratch: Any) -> Result:
        """Do the transfer; ``timeout`` bounds each get; ``scratch`` is the borrowed per-thread
        object (None when the pool has none or none is free)."""
        ...

    def discard(self, connector: Connector, result: Result | None) -> None:
        """Free what the job moved; ``result`` is run's result when it returned one."""
        ...


class TransferState(enum.Enum):
    QUEUED = "queued"         # submitted; waits for a thread and for room under max_held
    RUNNING = "running"       # a thread runs the job
    READY = "ready"           # done; the result waits for the engine to take it
    FAILED = "failed"         # ``error`` says why; the job was discarded before this
    TAKEN = "taken"           # the engine owns the result
    CANCELLED = "cancelled"   # the request went away; the job is (or will be) discarded


@dataclasses.dataclass(eq=False)
class Transfer(Generic[Result]):
    """One submitted job. ``state`` is written under the pool's lock; the engine reads it (a single
    attribute read) to see whether the transfer has finished."""

    job: TransferJob[Result]
    state: TransferState = TransferState.QUEUED
    result: Result | None = None
    error: OmniError | None = None
    scratch: Any = None   # borrowed while RUNNING or READY
    detached: bool = False   # a release: nobody takes its result, so it ends TAKEN, not READY

    @property
    def finished(self) -> bool:
        return self.state in (TransferState.READY, TransferState.FAILED)


class TransferPool:
    """Owns the transfer threads of one engine. ``submit``, ``take``, ``cancel`` and ``close`` are
    called from the engine's step thread."""

    # How long close() waits for the threads. A connector call in progress cannot be interrupted and
    # may run out the transfer timeout (30 s) in a store outage; the worker's stop budget (systemd's
    # TimeoutStopSec=90s) is spent by the drain (60 s) first, so waiting for it would leave no
    # margin before SIGKILL. A thread still running after this is logged and left to end by itself.
    CLOSE_JOIN_S = 2.0
    # How long an idle transfer thread waits for the next job before it ends.
    LINGER_S = 1.0

    def __init__(self, connector: Connector, *, timeout_s: float, max_held: int, threads: int = 2,
                 scratch: Callable[[], Any] | None = None, name: str = "transfer"):
        if max_held < 1 or threads < 1:
            raise ValueError("TransferPool needs max_held >= 1 and threads >= 1")
        self.connector = connector
        self.timeout_s = timeout_s
        self.max_held = max_held
        self.threads = threads
        self.name = name
        # One lock, two conditions: the engine waits on _cond for news (a finished transfer, a
        # poke); idle transfer threads wait on _work for a startable job. A poke on every broker
        # message must not wake the idle threads, nor a new job the engine.
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        self._work = threading.Condition(lock)
        self._queue: collections.deque[Transfer] = collections.deque()
        self._running: set[Transfer] = set()
        self._ready: set[Transfer] = set()
        self._held = 0                  # RUNNING + READY
        self._workers: list[threading.Thread] = []
        self._active = 0                # threads that have not yet decided to end
        self._scratch_free = [scratch() for _ in range(threads)] if scratch is not None else []
        self._news = False              # a transfer finished since the last wait_for_news
        self._closed = False

    # ------------------------------------------------------------------ step thread

    @property
    def num_pending(self) -> int:
        """Transfers queued or running."""
        with self._cond:
            return len(self._queue) + len(self._running)

    def submit(self, job: TransferJob[Result], *, detached: bool = False) -> Transfer[Result]:
        """Queue ``job``; from now on the transfer owns what it moves. A job that only writes,
        on a connector whose writes are local (:attr:`Connector.local_writes`), runs here and now
        and returns finished: it cannot stall the caller, and a thread would only add a hand-off.
        ``detached``: nobody will take the result (a :meth:`release`)."""
        ticket: Transfer[Result] = Transfer(job, detached=detached)
        with self._cond:
            if self._closed:
                ticket.state, ticket.error = TransferState.FAILED, TransferFailed(f"{self.name}: worker is shutting down")
            elif job.writes_only and self.connector.local_writes:
                self._start_locked(ticket, from_queue=False)
            else:
                self._queue.append(ticket)
                self._spawn_locked()
                return ticket
        if ticket.state is TransferState.FAILED:
            self._discard_quietly(ticket, None)
        else:
            self._execute(ticket, inline=True)
        return ticket

    def release(self, name: str, free: Callable[[Connector], None]) -> None:
        """Run ``free`` (deletes of keys nobody will read: ``name`` says which, for logs) off the
        caller's thread, or inline on a connector whose writes are local. Fire and forget: a free
        that fails is logged and its keys are left to their TTL; after close() it runs here."""
        self.submit(_Release(name, free), detached=True)

    @contextlib.contextmanager
    def take(self, ticket: Transfer[Result]) -> Iterator[Result]:
        """The READY ticket's result, now the caller's; its scratch is lent back after the ``with``."""
        with self._cond:
            if ticket.state is not TransferState.READY:
                raise RuntimeError(f"{self.name} of {ticket.job.name!r} is {ticket.state.value}, not ready")
            result, ticket.result, ticket.state = ticket.result, None, TransferState.TAKEN
            self._ready.discard(ticket)
        try:
            yield result
        finally:
            del result
            with self._cond:
                self._let_go_locked(ticket)

    def cancel(self, ticket: Transfer) -> None:
        """The request went away (cancel, deadline, rejection): drop the transfer and what it moves."""
        with self._cond:
            state = ticket.state
            if state in (TransferState.FAILED, TransferState.TAKEN, TransferState.CANCELLED):
                return
            ticket.state = TransferState.CANCELLED
            result, ticket.result = ticket.result, None
            if state is TransferState.QUEUED:
                self._queue.remove(ticket)
            elif state is TransferState.READY:
                self._ready.discard(ticket)
                self._let_go_locked(ticket)
        if state is not TransferState.RUNNING:   # a running one is discarded by its thread
            self._discard_quietly(ticket, result)

    def poke(self) -> None:
        """End the current (or next) :meth:`wait_for_news` now; safe from any thread (the broker
        link calls it, through the engine's ``wake``, when a task or cancel arrives)."""
        with self._cond:
            self._news = True
            self._cond.notify_all()

    def wait_for_news(self, timeout: float) -> None:
        """Wait until a transfer finishes, :meth:`poke` is called, or ``timeout``: lets a step with
        nothing to run sleep instead of spinning while only transfers are pending."""
        with self._cond:
            self._cond.wait_for(lambda: self._news or self._closed, timeout)
            self._news = False

    def close(self) -> None:
        """Cancel every transfer not yet taken and join every thread, waiting at most
        :attr:`CLOSE_JOIN_S` in all (a thread inside a connector call is logged and left to end
        when it returns, discarding its job). The queued and ready jobs are discarded on a thread
        of their own under the same bound (a discard is a connector call too: during a Redis
        outage each can block for the socket timeout). Idempotent."""
        with self._cond:
            self._closed = True
            self._work.notify_all()
            idle = [(ticket, None) for ticket in self._queue] + [(ticket, ticket.result) for ticket in self._ready]
            self._queue.clear()
            self._ready.clear()
            for ticket in [t for t, _ in idle] + list(self._running):
                ticket.state, ticket.result = TransferState.CANCELLED, None
            self._cond.notify_all()
            workers = list(self._workers)
        if idle:
            releaser = threading.Thread(target=self._discard_all, args=(idle,), name=f"{self.name}-release",
                                        daemon=True)
            releaser.start()
            workers.append(releaser)
        deadline = time.monotonic() + self.CLOSE_JOIN_S
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._workers = [w for w in workers if w.is_alive()]
            stuck = sorted(ticket.job.name for ticket in self._running)
        if self._workers:
            log.warning("closing with %d %s thread(s) still inside a connector call after %.0f s (%s): each ends "
                        "when its call returns, discarding that transfer", len(self._workers), self.name,
                        self.CLOSE_JOIN_S, ", ".join(stuck) or "finishing")

    def _discard_all(self, tickets: list[tuple[Transfer, Any]]) -> None:
        for ticket, result in tickets:
            self._discard_quietly(ticket, result)

    # ------------------------------------------------------------------ bookkeeping (lock held)

    def _let_go_locked(self, ticket: Transfer) -> None:
        """A held transfer left (taken, dropped or failed): its place under max_held, and its
        scratch, are free."""
        self._held -= 1
        if ticket.scratch is not None:
            self._scratch_free.append(ticket.scratch)
            ticket.scratch = None
        self._spawn_locked()

    def _startable_locked(self) -> int:
        return 0 if self._closed else min(len(self._queue), self.max_held - self._held)

    def _spawn_locked(self) -> None:
        """A transfer may have become startable (submitted, or a held one left): wake the idle
        threads, and start more while startable transfers outnumber the threads free to take them
        (a thread inside a transfer is not free)."""
        startable = self._startable_locked()
        if startable:
            self._work.notify(startable)
        while self._active < self.threads and self._active - len(self._running) < startable:
            self._workers = [w for w in self._workers if w.is_alive()]
            # daemon: a thread close() stopped waiting for must not keep the process alive
            worker = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._active += 1
            self._workers.append(worker)
            worker.start()

    # ------------------------------------------------------------------ transfer threads

    def _run(self) -> None:
        while True:
            with self._cond:
                idle_until = time.monotonic() + self.LINGER_S
                while self._startable_locked() == 0:
                    left = idle_until - time.monotonic()
                    if self._closed or left <= 0:
                        self._active -= 1
                        return
                    self._work.wait(left)
                ticket = self._queue.popleft()
                self._start_locked(ticket)
            self._execute(ticket)

    def _start_locked(self, ticket: Transfer, from_queue: bool = True) -> None:
        ticket.state = TransferState.RUNNING
        if from_queue:   # an inline write borrows no scratch: only reads assemble into it
            ticket.scratch = self._scratch_free.pop() if self._scratch_free else None
        self._running.add(ticket)
        self._held += 1

    def _execute(self, ticket: Transfer, inline: bool = False) -> None:
        """Run a RUNNING ticket's job (on a transfer thread, or ``inline`` for a local write) and
        leave it READY, FAILED (discarded first) or, if cancelled meanwhile, discarded. Only a
        thread's result is news: an inline one is the caller's own, and must not cut its next idle
        wait short."""
        result, error = None, None
        try:
            timeout = max(0.0, min(self.timeout_s, ticket.job.deadline - time.time()))
            result = ticket.job.run(_StopsWhenCancelled(self.connector, ticket), timeout, ticket.scratch)
        except OmniError as exc:
            error = exc
        except Exception as exc:   # noqa: BLE001 - on this thread it would vanish and hang the request
            log.exception("%s of %r failed", self.name, ticket.job.name)
            error = TransferFailed(f"{self.name} of {ticket.job.name!r} failed: {type(exc).__name__}: {exc}")
        if error is not None or ticket.state is TransferState.CANCELLED:
            # Before the state changes, so a request reported failed has nothing left.
            self._discard_quietly(ticket, result)
            result = None
        with self._cond:
            self._running.discard(ticket)
            if ticket.state is TransferState.CANCELLED or error is not None:
                if ticket.state is not TransferState.CANCELLED:
                    ticket.state, ticket.error = TransferState.FAILED, error
                self._let_go_locked(ticket)
            elif ticket.detached:
                ticket.state = TransferState.TAKEN
                self._let_go_locked(ticket)
            else:
                ticket.state, ticket.result = TransferState.READY, result
                self._ready.add(ticket)
            if not inline:
                self._news = True
                self._cond.notify_all()
        del result

    def _discard_quietly(self, ticket: Transfer, result: Any) -> None:
        """job.discard that never raises (a transfer thread would die with the exception; a
        close() may have let the owner close the connector meanwhile)."""
        try:
            ticket.job.discard(self.connector, result)
        except Exception as exc:   # noqa: BLE001 - best-effort clean-up; keys expire by their TTL
            log.warning("could not discard the %s of %r (left to expire): %s: %s", self.name, ticket.job.name,
                        type(exc).__name__, exc)


@dataclasses.dataclass(eq=False)
class _Release:
    """A :meth:`TransferPool.release`: ``free`` runs once as the job, or as its discard when the job
    never ran to its end (the pool closed first, or the free raised: deletes may be repeated)."""

    name: str
    free: Callable[[Connector], None]
    deadline: float = float("inf")   # it waits for no key
    writes_only: bool = True
    done: bool = False

    def run(self, connector: Connector, timeout: float, scratch: Any) -> None:
        self.free(connector)
        self.done = True

    def discard(self, connector: Connector, result: None) -> None:
        if not self.done:
            self.done = True
            self.free(connector)


class _StopsWhenCancelled(ConnectorWrapper):
    """The connector as one transfer sees it: once its request is cancelled, the next ``get``
    fails at once, so a job deletes what is left unread instead of fetching it."""

    def __init__(self, inner: Connector, ticket: Transfer):
        super().__init__(inner)
        self.ticket = ticket

    def get(self, key: str, handle: Handle | None = None, timeout: float = DEFAULT_GET_TIMEOUT_S) -> Payload:
        if self.ticket.state is TransferState.CANCELLED:
            raise TransferFailed(f"transfer of {self.ticket.job.name!r} was cancelled")
        return self.inner.get(key, handle, timeout)

    def close(self) -> None:
        """The transfer does not own the connector."""
