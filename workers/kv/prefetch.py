"""Decode's KV import, off the step thread: new requests' KVs arrive while the batch keeps stepping.

A connector ``get`` blocks: on a Redis outage, a slow link or a layerwise KV whose pieces trickle in,
up to the transfer timeout. Run on the step thread it would stall every running stream of the
worker; here it runs on a small pool of threads and the engine admits a request once its KV is
on the host. Only the connector work moves: writing the KV into the paged pool
(``runner.write_kv``) stays on the step thread, and the imports run in rank 0's process like
before (a TP/PP group's other ranks never touch the connector).

Life of one import (:class:`KVImport`, made by :meth:`KVPrefetcher.submit`)::

    QUEUED ──a thread is free and fewer than max_held KVs are held──▶ IMPORTING: import_kv (the
        gets, the layerwise assembly, the deletes of every key) ──▶ READY: the KV held on the host
        ──take(): the engine writes it into its blocks──▶ TAKEN
    IMPORTING ──an OmniError (or any exception, as TransferFailed)──▶ its keys released (on the
        import thread) ──▶ FAILED: the engine fails the request with the error's error_type
    cancel(): QUEUED → CANCELLED, its keys released at once (on the caller's thread);
              IMPORTING → CANCELLED, the result dropped and, if the import failed, its keys
                  released when it returns (on the import thread);
              READY → CANCELLED, the KV dropped (its keys were deleted by the import)

Why a failed import releases its keys before the request fails: nobody will read them. The broker
either fails the request or restarts it from prefill under a new attempt, whose KV goes under new
keys (``kv/<request_id>/<attempt>``); left alone, this attempt's KV (a get that timed out while the
key arrived late, a get that failed while the key was there) would hold shared memory or store
space until the TTL. Releasing is best-effort (:func:`~.kv_export.release_kv`): a store still down
leaves them to the TTL.

An import cannot be interrupted: a ``get`` in progress runs out its own timeout (the transfer
timeout, capped by the request's deadline). A cancelled one issues no further get: its remaining
layerwise pieces are deleted without being read.

Memory bound: at most ``max_held`` KVs are IMPORTING or READY at once, i.e. imported (or being
imported) and not yet written into the pool; further imports wait QUEUED. The engine passes its
``max_num_seqs``: host memory for KVs in waiting is then at most one full batch of admissions
(``max_num_seqs`` × the largest KV, ``max_model_len`` tokens), and a READY KV beyond the batch's
free slots could not be admitted anyway. (A worker also holds at most ``capacity`` requests, the
credits it grants, so in the daemon the bound rarely binds.) A READY KV from the
``shared_memory`` connector may be a view of the producer's segment: the bound caps those too.

Threads: at most ``threads`` (default 2; each backend's ``get`` is safe from several threads at
once, which the connector contract suite checks with three). A thread is started by
:meth:`KVPrefetcher.submit` (or when a held KV leaves) while startable imports outnumber the
running threads, and ends by itself when none is left, so an idle prefetcher holds no thread;
:meth:`KVPrefetcher.close` (the engine's ``close``) cancels what is queued or in flight and joins
every thread, for at most :attr:`KVPrefetcher.CLOSE_JOIN_S`: a thread still inside a get then (a
store outage: up to the transfer timeout) is logged and left to finish it. Threads are daemon
threads so that such a one does not hold up the process's exit. When its get returns, it only
releases the import's keys, best-effort (any exception logged and swallowed: the connector may
have been closed meanwhile), issues no further get and ends.

The layerwise assembly buffers (:class:`StagingBuffer`, warm memory reused across imports) are one
per thread: an import borrows a free one and a READY KV keeps it until the engine has written it;
with none free, the import assembles into fresh memory.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Iterator

import torch

from omnirelay.connectors import Connector
from omnirelay.connectors.base import DEFAULT_GET_TIMEOUT_S, Handle, Payload
from omnirelay.errors import OmniError, TransferFailed

from omnirelay.handoffs import release_kv
from omnirelay.workers.kv.export import StagingBuffer, import_kv

log = logging.getLogger("omnirelay.worker.kv_prefetch")


class ImportState(enum.Enum):
    QUEUED = "queued"         # submitted; waits for a thread and for room under max_held
    IMPORTING = "importing"   # a thread runs its gets
    READY = "ready"           # the KV is on the host, waiting for the engine to take it
    FAILED = "failed"         # ``error`` says why; its keys were released (best-effort) before this
    TAKEN = "taken"           # the engine wrote it into its blocks
    CANCELLED = "cancelled"   # the request went away; nothing of it is kept


@dataclasses.dataclass(eq=False)
class KVImport:
    """One request's KV import. ``state`` is written under the prefetcher's lock; the engine reads it
    (a single attribute read) to see whether the import has finished."""

    key: str
    handle: Handle | None
    num_tokens: int      # the prompt length the KV must cover
    deadline: float      # the request's deadline (``time.time()`` clock): no get waits past it
    state: ImportState = ImportState.QUEUED
    kv: torch.Tensor | None = None
    error: OmniError | None = None
    staging: StagingBuffer | None = None   # borrowed while IMPORTING or READY

    @property
    def finished(self) -> bool:
        return self.state in (ImportState.READY, ImportState.FAILED)


class KVPrefetcher:
    """Owns the import threads of one decode engine. ``submit``, ``take``, ``cancel`` and ``close``
    are called from the engine's step thread."""

    # How long close() waits for the import threads. A get in progress cannot be interrupted and may
    # run out the transfer timeout (30 s) in a store outage; the worker's stop budget (systemd's
    # TimeoutStopSec=90s) is spent by the drain (60 s) first, so waiting for it would leave no margin
    # before SIGKILL. A thread still running after this is logged and left to end by itself.
    CLOSE_JOIN_S = 2.0

    def __init__(self, connector: Connector, *, timeout_s: float, max_held: int, threads: int = 2):
        if max_held < 1 or threads < 1:
            raise ValueError("KVPrefetcher needs max_held >= 1 and threads >= 1")
        self.connector = connector
        self.timeout_s = timeout_s
        self.max_held = max_held
        self.threads = threads
        self._cond = threading.Condition()
        self._queue: collections.deque[KVImport] = collections.deque()
        self._importing: set[KVImport] = set()
        self._held = 0                  # IMPORTING + READY
        self._workers: list[threading.Thread] = []
        self._active = 0                # threads that have not yet decided to end
        self._staging_free = [StagingBuffer() for _ in range(threads)]
        self._news = False              # an import finished since the last wait_for_news
        self._closed = False

    # ------------------------------------------------------------------ step thread

    @property
    def num_pending(self) -> int:
        """Imports queued or in flight (the heartbeat's ``kv_imports_inflight``)."""
        with self._cond:
            return len(self._queue) + len(self._importing)

    def submit(self, key: str, handle: Handle | None, num_tokens: int, deadline: float) -> KVImport:
        """Queue the import of the KV under ``key``; from now on the import owns that key."""
        ticket = KVImport(key, handle, num_tokens, deadline)
        with self._cond:
            if self._closed:
                ticket.state, ticket.error = ImportState.FAILED, TransferFailed("decode worker is shutting down")
                return ticket
            self._queue.append(ticket)
            self._spawn_locked()
        return ticket

    @contextlib.contextmanager
    def take(self, ticket: KVImport) -> Iterator[torch.Tensor]:
        """The READY ticket's KV, valid inside the ``with`` (its staging buffer is lent back after)."""
        with self._cond:
            if ticket.state is not ImportState.READY:
                raise RuntimeError(f"KV import of {ticket.key!r} is {ticket.state.value}, not ready")
            kv, ticket.kv, ticket.state = ticket.kv, None, ImportState.TAKEN
        try:
            yield kv
        finally:
            del kv
            with self._cond:
                self._let_go_locked(ticket)

    def cancel(self, ticket: KVImport) -> None:
        """The request went away (cancel, deadline, rejection): drop the import and its keys."""
        with self._cond:
            state = ticket.state
            if state in (ImportState.FAILED, ImportState.TAKEN, ImportState.CANCELLED):
                return
            ticket.state = ImportState.CANCELLED
            if state is ImportState.QUEUED:
                self._queue.remove(ticket)
            elif state is ImportState.READY:
                ticket.kv = None
                self._let_go_locked(ticket)
        if state is ImportState.QUEUED:   # never read: delete it as an unimported handoff
            release_kv(self.connector, ticket.key, ticket.handle)

    def wait_for_news(self, timeout: float) -> None:
        """Wait until an import finishes (or ``timeout``): lets a step with nothing to run sleep
        instead of spinning while only imports are pending."""
        with self._cond:
            self._cond.wait_for(lambda: self._news or self._closed, timeout)
            self._news = False

    def close(self) -> None:
        """Cancel queued and in-flight imports and join every thread, waiting at most
        :attr:`CLOSE_JOIN_S` in all: a get in progress runs out its own timeout, so a thread still
        inside one is logged and left to end when it returns (releasing that import's keys). The
        queued imports' keys are released on a thread of their own under the same bound (a
        release is a connector call too: during a Redis outage each can block for the socket
        timeout). Idempotent."""
        with self._cond:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            for ticket in queued + list(self._importing):
                ticket.state = ImportState.CANCELLED
            self._cond.notify_all()
            workers = list(self._workers)
        if queued:
            releaser = threading.Thread(target=self._release_all, args=(queued,), name="kv-release", daemon=True)
            releaser.start()
            workers.append(releaser)
        deadline = time.monotonic() + self.CLOSE_JOIN_S
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._workers = [w for w in workers if w.is_alive()]
            stuck = sorted(ticket.key for ticket in self._importing)
        if self._workers:
            log.warning("closing with %d KV import thread(s) still inside a connector call after %.0f s (%s): "
                        "each ends when its call returns, releasing that import's keys",
                        len(self._workers), self.CLOSE_JOIN_S, ", ".join(stuck) or "finishing")

    def _release_all(self, tickets: list[KVImport]) -> None:
        for ticket in tickets:
            self._release_quietly(ticket)

    # ------------------------------------------------------------------ bookkeeping (lock held)

    def _let_go_locked(self, ticket: KVImport) -> None:
        """A held KV left (taken or dropped): its place under max_held, and its buffer, are free."""
        self._held -= 1
        if ticket.staging is not None:
            self._staging_free.append(ticket.staging)
            ticket.staging = None
        self._spawn_locked()

    def _startable_locked(self) -> int:
        return 0 if self._closed else min(len(self._queue), self.max_held - self._held)

    def _spawn_locked(self) -> None:
        """Start threads while startable imports outnumber the threads free to take them (a thread
        inside an import is not free)."""
        while self._active < self.threads and self._active - len(self._importing) < self._startable_locked():
            self._workers = [w for w in self._workers if w.is_alive()]
            # daemon: a thread close() stopped waiting for must not keep the process alive
            worker = threading.Thread(target=self._run, name="kv-import", daemon=True)
            self._active += 1
            self._workers.append(worker)
            worker.start()

    # ------------------------------------------------------------------ import threads

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._startable_locked() == 0:
                    self._active -= 1
                    return
                ticket = self._queue.popleft()
                ticket.state = ImportState.IMPORTING
                ticket.staging = self._staging_free.pop() if self._staging_free else None
                self._importing.add(ticket)
                self._held += 1
            kv, error = None, None
            try:
                kv = self._import(ticket)
            except OmniError as exc:
                error = exc
            except Exception as exc:   # noqa: BLE001 - on this thread it would vanish and hang the request
                log.exception("KV import of %r failed", ticket.key)
                error = TransferFailed(f"KV import of {ticket.key!r} failed: {type(exc).__name__}: {exc}")
            if error is not None:
                # What a failed import may have left (a get that timed out before its key appeared,
                # one that failed with the key there), cancelled or not: no one will read it. Before
                # the state changes, so a request reported failed has no keys left.
                self._release_quietly(ticket)
            with self._cond:
                self._importing.discard(ticket)
                cancelled = ticket.state is ImportState.CANCELLED
                if cancelled or error is not None:
                    if not cancelled:
                        ticket.state, ticket.error = ImportState.FAILED, error
                    self._let_go_locked(ticket)
                else:
                    ticket.state, ticket.kv = ImportState.READY, kv
                self._news = True
                self._cond.notify_all()
            del kv

    def _release_quietly(self, ticket: KVImport) -> None:
        """release_kv on an import thread: never raises (the thread would die with the exception),
        also not when close() has returned and the owner closed the connector meanwhile."""
        try:
            release_kv(self.connector, ticket.key, ticket.handle)
        except Exception as exc:   # noqa: BLE001 - best-effort clean-up; the key expires by its TTL
            log.warning("could not release the KV under %r (left to expire): %s: %s", ticket.key,
                        type(exc).__name__, exc)

    def _import(self, ticket: KVImport) -> torch.Tensor:
        timeout = max(0.0, min(self.timeout_s, ticket.deadline - time.time()))
        kv = import_kv(_StopsWhenCancelled(self.connector, ticket), ticket.key, ticket.handle, timeout=timeout,
                       staging=ticket.staging)
        if kv.shape[2] != ticket.num_tokens:
            raise OmniError(f"KV under {ticket.key!r} covers {kv.shape[2]} tokens, prompt has {ticket.num_tokens}")
        return kv


class _StopsWhenCancelled(Connector):
    """The connector as one import sees it: once its request is cancelled, the next ``get`` fails
    at once, so import_kv deletes the remaining layerwise pieces unread instead of fetching them."""

    def __init__(self, inner: Connector, ticket: KVImport):
        self.inner = inner
        self.ticket = ticket
        self.name = inner.name

    def get(self, key: str, handle: Handle | None = None, timeout: float = DEFAULT_GET_TIMEOUT_S) -> Payload:
        if self.ticket.state is ImportState.CANCELLED:
            raise TransferFailed(f"KV import of {self.ticket.key!r} was cancelled")
        return self.inner.get(key, handle, timeout)

    def put(self, key: str, payload: Payload) -> Handle:
        return self.inner.put(key, payload)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def close(self) -> None:
        """The import does not own the connector."""

    def health(self) -> dict:
        return self.inner.health()
