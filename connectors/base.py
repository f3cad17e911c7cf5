"""The connector contract: how tensors and KV caches move from one worker to another.

A connector is the data plane between two stages. The broker never sees the data, only the small
``handle`` maps that :meth:`Connector.put` returns, which travel in the bus messages
(``StageDone.outputs`` → ``Task.inputs``). Backends: ``shared_memory`` (one host), and — chosen by
name in the stage YAML, imported only when chosen — ``redis``, ``mooncake_transfer_engine``,
``mooncake_store``, ``yuanrong``. A KV cache that leaves layer by layer (``workers/kv/export.py``) is one payload
per layer plus a manifest, over these same methods.

Payload
    A flat ``dict[str, value]`` where a value is a ``torch.Tensor`` (any dtype, any shape, empty and
    non-contiguous included), ``bytes``, or a msgpack-able value (None, bool, int, float, str, and
    lists/maps of those). :mod:`omnirelay.connectors.codec` turns it into one msgpack header plus the
    raw tensor bytes; nothing is pickled.

Who calls what
    ``put`` is called by the producing stage's worker (prefill for KV, encode for embeddings) from
    its engine thread, once per key. ``get`` and ``delete`` are called by the consuming worker, once
    per key, after the broker handed it the handle. ``health`` may be called from any thread at any
    time and must not block. ``close`` is called once by the owner at shutdown; further calls are
    no-ops. One connector object serves both sides; which side a worker plays is decided by the
    stage it runs, not by configuration.

Blocking
    ``put`` blocks until the payload is readable by a consumer (written and published) and returns
    its handle; it never waits for a consumer. ``get`` blocks until the key is readable or
    ``timeout`` seconds pass (:class:`~omnirelay.errors.TransferFailed`, whose message names the
    key and, for a network backend, what failed); key-only retrieval (no handle) works for every
    backend, the handle only makes it faster, and a stale handle (the key was put again) falls back
    to looking the key up. A handle also says the producer had finished: a backend that can tell
    the key no longer exists (Redis restarted empty) fails at once instead of waiting out ``timeout``. ``delete`` does not block on remote peers longer than one round trip.
    Every method is safe to call from several threads. A backend whose writes (``put``,
    ``put_reserved``, ``release``, ``delete``) are memory operations on this host that never wait on
    a network, a peer or another process says so with ``local_writes = True`` (shared memory): the
    engines then run such writes inline rather than on a transfer thread.

Buffers and ownership
    ``put`` copies the payload out; the caller may reuse its tensors as soon as it returns. Tensors
    returned by ``get`` may be zero-copy views into backend memory (a shared memory segment, or a
    block of the connector's receive pool): they stay valid for as long as the caller holds a
    reference, even after ``delete`` or a new ``put`` of the key, because that memory is recycled
    only once they are gone. Writes into them stay private to the caller. Since they pin backend
    memory, the caller copies what it keeps (into its KV cache) and drops them.

Writing in place (``reserve`` → ``put_reserved``)
    A producer that builds a tensor only to hand it over (the prefill's KV gather) can build it
    straight in the memory the backend transfers from and skip ``put``'s copy: ``reserve({name:
    (shape, dtype)})`` returns a :class:`Reservation` whose ``tensors`` are writable, contiguous and
    uninitialised; the producer fills them (``torch.index_select(..., out=...)``) and calls
    ``put_reserved(key, reservation, extra)``, which publishes exactly what ``put(key,
    {**reservation.tensors, **extra})`` would, with the same blocking, handle and lifetime. From
    that call on the tensors belong to the connector: the producer drops them and never writes
    them again (a consumer may be reading that memory). A reservation that will not be published
    goes back with ``release(reservation)``; ``put_reserved`` releases it itself when it fails.
    One thread at a time uses a reservation, and it is used once (prefill fills it on its step
    thread and may publish it from a transfer thread, handing it over through a queue). Every backend lends the
    memory its ``put`` would encode into (a shared memory segment, a registered pool block, the
    Redis send buffer), so ``put_reserved`` writes only the header and the ``extra`` items; the
    defaults here lend ordinary tensors and copy, so a wrapper or a new backend works unchanged, and
    a backend handed another's reservation copies it.

When a key dies
    1. The consumer deletes it after a successful ``get`` (consumer-acknowledged delete) — the normal
       path.
    2. Otherwise a TTL (``ttl_s`` option, default 300 s) bounds how long data whose consumer never
       came (a cancelled request, a dead worker) outlives its put: Redis expires every key itself;
       the other backends' producers expire their own payloads on their next ``put`` and on
       ``close``.
    3. When the producer goes: shared memory segments outlive a crashed producer until the next
       connector starts in that directory or ``omni-serve`` sweeps (every name carries its owner's
       PID, :func:`~omnirelay.connectors.shared_memory.sweep_orphans`); the Mooncake backends keep
       payloads in the producer's memory or store segment, so those die with its connector or
       process, and a later ``get`` fails with ``TransferFailed``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from . import codec

Payload = dict[str, Any]
Handle = dict[str, Any]
Layout = dict[str, tuple[Sequence[int], torch.dtype]]

DEFAULT_GET_TIMEOUT_S = 30.0
DEFAULT_TTL_S = 300.0


@dataclasses.dataclass(eq=False)
class Lent:
    """Where a backend's reservation lives: ``memory`` is the backend's own (a segment, a pool
    block, a send buffer), ``layout`` where the tensors lie in the encoded payload, ``room`` how
    many bytes the whole encoded payload may take there."""

    owner: "Connector"
    memory: Any
    layout: codec.ReservedLayout
    room: int


@dataclasses.dataclass(eq=False)
class Reservation:
    """Tensors lent by :meth:`Connector.reserve`, to be filled and published once.

    ``tensors``: name → writable contiguous tensor, in the order of the layout. ``memory``: the
    lending backend's :class:`Lent` (None when they are ordinary tensors)."""

    tensors: dict[str, torch.Tensor]
    memory: Lent | None = None
    done: bool = False


def check_layout(layout: Layout) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``layout`` with shapes as int tuples; ValueError naming the first bad entry."""
    checked = {}
    for name, spec in layout.items():
        if not isinstance(name, str):
            raise ValueError(f"reserve: tensor names must be str, got {type(name).__name__}")
        try:
            shape, dtype = spec
            shape = tuple(int(s) for s in shape)
        except (TypeError, ValueError):
            raise ValueError(f"reserve: {name}: expected (shape, dtype), got {spec!r}") from None
        if not isinstance(dtype, torch.dtype) or any(s < 0 for s in shape):
            raise ValueError(f"reserve: {name}: bad shape or dtype {spec!r}")
        checked[name] = (shape, dtype)
    return checked


def reserved_payload(reservation: Reservation, extra: Payload | None) -> Payload:
    """The payload a reservation publishes: its tensors, then ``extra`` (names must not clash)."""
    if reservation.done:
        raise ValueError("put_reserved: this reservation was already published or released")
    extra = extra or {}
    clash = reservation.tensors.keys() & extra.keys()
    if clash:
        raise ValueError(f"put_reserved: extra repeats reserved names {sorted(clash)}")
    return {**reservation.tensors, **extra}


class Connector(abc.ABC):
    """Abstract base of every backend. Keep this surface small: five methods, plus the in-place
    trio (``reserve``, ``put_reserved``, ``release``) whose defaults copy like ``put``."""

    name: str = ""
    # Declared, not probed (see "Blocking" above). A transfer thread would buy such writes no
    # overlap (the work holds the GIL) and cost a thread hand-off per call. Gets may still wait.
    local_writes: bool = False

    @abc.abstractmethod
    def put(self, key: str, payload: Payload) -> Handle:
        """Store ``payload`` under ``key``; return a small msgpack-able handle for the consumer."""

    @abc.abstractmethod
    def get(self, key: str, handle: Handle | None = None, timeout: float = DEFAULT_GET_TIMEOUT_S) -> Payload:
        """Return the payload stored under ``key`` (waiting up to ``timeout`` seconds for it)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Forget ``key``. Deleting a missing key is not an error."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the backend's resources. Idempotent."""

    @abc.abstractmethod
    def health(self) -> dict:
        """Non-blocking status: ``{"backend", "ok", …counters such as bytes_put/bytes_got}``."""

    def reserve(self, layout: Layout) -> Reservation:
        """Writable tensors of ``layout`` (``{name: (shape, dtype)}``) for :meth:`put_reserved`.
        This default lends ordinary tensors; a backend lends its own memory by overriding this
        (placing the tensors with :func:`codec.reserve_layout`, returning a :class:`Lent`) and
        :meth:`_put_lent` / :meth:`_return_lent`."""
        return Reservation({name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in check_layout(layout).items()})

    def put_reserved(self, key: str, reservation: Reservation, extra: Payload | None = None) -> Handle:
        """Publish a filled reservation (plus ``extra`` items) under ``key``, as ``put`` would:
        in place when this connector lent the memory and the added items fit it, else by copying.
        The reservation is over when this returns or raises."""
        lent = reservation.memory
        if not (isinstance(lent, Lent) and lent.owner is self):   # ordinary tensors, or another's
            try:
                return self.put(key, reserved_payload(reservation, extra))
            finally:
                self.release(reservation)
        kept = False
        try:
            payload = reserved_payload(reservation, extra)   # ValueError: used already, or names clash
            encode_plan = codec.plan_reserved(lent.layout, extra or {})
            if encode_plan is None or encode_plan.size > lent.room:
                self._count("reserved_copied")   # the added items do not fit: copy like any put
                return self.put(key, payload)
            handle, kept = self._put_lent(key, lent, encode_plan)
            self._count("puts_in_place")
            return handle
        finally:
            reservation.done, reservation.tensors, reservation.memory = True, {}, None
            self._return_lent(lent, kept=kept)

    def release(self, reservation: Reservation) -> None:
        """Give back a reservation that will not be published (idempotent)."""
        lent = reservation.memory
        reservation.done, reservation.tensors, reservation.memory = True, {}, None
        if isinstance(lent, Lent) and lent.owner is self:
            self._return_lent(lent, kept=False)

    # Hooks of a backend that lends its own memory (see reserve).

    def _put_lent(self, key: str, lent: Lent, encode_plan: codec.EncodePlan) -> tuple[Handle, bool]:
        """Write ``encode_plan`` (the header and the added items) around the filled tensors and
        publish under ``key``: (the handle, whether the payload now keeps ``lent.memory``)."""
        raise NotImplementedError(f"{type(self).__name__} lends memory but cannot publish it in place")

    def _return_lent(self, lent: Lent, kept: bool) -> None:
        """A reservation of ours ended: free ``lent.memory`` unless the payload ``kept`` it (also
        called after a failed publish, with ``kept`` False)."""

    def _count(self, event: str) -> None:
        """Add one to the ``health()`` counter ``event``."""

    def __enter__(self) -> "Connector":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ConnectorWrapper(Connector):
    """A connector that adds something to another (``inner``) and passes every call on to it: a
    subclass overrides only the calls it changes. It takes the inner backend's name and
    ``local_writes``, and the reservations it hands out are the inner backend's own."""

    def __init__(self, inner: Connector):
        self.inner = inner
        self.name = inner.name
        self.local_writes = inner.local_writes

    def put(self, key: str, payload: Payload) -> Handle:
        return self.inner.put(key, payload)

    def get(self, key: str, handle: Handle | None = None, timeout: float = DEFAULT_GET_TIMEOUT_S) -> Payload:
        return self.inner.get(key, handle, timeout)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def close(self) -> None:
        self.inner.close()

    def health(self) -> dict:
        return self.inner.health()

    def reserve(self, layout: Layout) -> Reservation:
        return self.inner.reserve(layout)

    def put_reserved(self, key: str, reservation: Reservation, extra: Payload | None = None) -> Handle:
        return self.inner.put_reserved(key, reservation, extra)

    def release(self, reservation: Reservation) -> None:
        self.inner.release(reservation)
