"""The connector contract: how tensors and KV caches move from one worker to another.

A connector is the data plane between two stages. The broker never sees the data, only the small
``handle`` maps that :meth:`Connector.put` returns, which travel in the bus messages
(``StageDone.outputs`` → ``Task.inputs``). Backends: ``shared_memory`` (one host), and — chosen by
name in the stage YAML, imported only when chosen — ``redis``, ``mooncake_transfer_engine``,
``mooncake_store``. :mod:`omnirelay.connectors.chunked` streams a sequence of payloads (layer by
layer, chunk by chunk) over any of them with these same five methods.

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
    Every method is safe to call from several threads.

Buffers and ownership
    ``put`` copies the payload out; the caller may reuse its tensors as soon as it returns. Tensors
    returned by ``get`` may be zero-copy views into backend memory (a shared memory segment, or a
    block of the connector's receive pool): they stay valid for as long as the caller holds a
    reference, even after ``delete`` or a new ``put`` of the key, because that memory is recycled
    only once they are gone. Writes into them stay private to the caller. Since they pin backend
    memory, the caller copies what it keeps (into its KV cache) and drops them.

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
from typing import Any

Payload = dict[str, Any]
Handle = dict[str, Any]

DEFAULT_GET_TIMEOUT_S = 30.0
DEFAULT_TTL_S = 300.0


class Connector(abc.ABC):
    """Abstract base of every backend. Keep this surface small: five methods."""

    name: str = ""

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

    def __enter__(self) -> "Connector":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
