"""``mooncake_store`` connector: payloads in a Mooncake distributed store (``mooncake_master`` plus
the memory segments its clients contribute).

Each connector is one store client: it mounts a ``segment_mb`` slice of its own memory into the
store and registers one :class:`BufferPool` for zero-copy ``put_from`` / ``get_into``.

* ``put``: encode into a pool block, ``upsert_from(key, block)`` (replaces an older value of the
  key), preferring this client's own segment (``prefer_local``) so the write is a local copy and
  the consumer pulls the bytes over the transfer engine. Handle: ``{"size": bytes}``.
* In place: ``reserve`` lends tensors that are views of such a registered block (with room after
  them for small added items); ``put_reserved`` writes the header and the added items around them,
  upserts the block as ``put`` does and frees it (the store has its own copy by then).
* ``get``: ``get_size`` (skipped when the handle gives the size) until the key exists or the
  timeout passes, then ``get_into`` a pool block; tensors are views into that block, which is
  recycled when they die. Key-only retrieval is native: the master knows every key.
* ``delete``: ``remove(key, force=True)`` (force: a reader's lease must not keep a consumed key).
* TTL: the master has no per-key expiry, so the producer removes keys it put that are older than
  ``ttl_s`` (checked on every put and on close). Under memory pressure the master also evicts.

A client's segment leaves the store with it: payloads placed there are lost when the producer's
connector closes or its process dies (the master notices after its ``client_ttl``), and a ``get``
then fails with ``TransferFailed``.

Options: ``master`` (required, ``host:port`` of ``mooncake_master``), ``local_hostname``
(127.0.0.1), ``metadata_server`` (``P2PHANDSHAKE``), ``protocol`` (``tcp``), ``device_name`` (""),
``segment_mb`` (512), ``local_buffer_mb`` (16: Mooncake's own staging buffer, unused by this
connector's zero-copy paths), ``pool_mb`` (256), ``ttl_s`` (300), ``prefer_local`` (true).
"""

from __future__ import annotations

import collections
import threading
import time

from omnirelay.errors import TransferFailed

from . import codec
from .base import DEFAULT_GET_TIMEOUT_S, DEFAULT_TTL_S, Connector, Handle, Layout, Lent, Payload, Reservation, check_layout
from .buffers import Block, Region
from .mooncake_pool import RegisteredPool

try:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig
except ImportError as exc:  # pragma: no cover - depends on the optional extra
    raise ImportError("the mooncake_store connector needs the 'mooncake' extra: "
                      "pip install 'omnirelay[mooncake]' (and Debian libibverbs1)") from exc

OBJECT_NOT_FOUND = -704   # Mooncake's error code for a key the master does not know

# Block room a reservation keeps after its tensors for the data of ``put_reserved``'s bytes items:
# small ones (token ids, a short blob) then go in place too, for one page per reservation; larger
# ones fall back to a copy.
EXTRA_DATA_ROOM = 4096


class MooncakeStoreConnector(Connector):
    name = "mooncake_store"

    def __init__(self, config: dict | None = None):
        config = dict(config or {})
        master = config.pop("master", None)
        if not isinstance(master, str) or ":" not in master:
            raise ValueError("mooncake_store connector: option 'master' (host:port of mooncake_master) is required")
        self.master = master
        local_hostname = str(config.pop("local_hostname", "127.0.0.1"))
        metadata_server = str(config.pop("metadata_server", "P2PHANDSHAKE"))
        protocol = str(config.pop("protocol", "tcp"))
        device_name = str(config.pop("device_name", ""))
        segment_bytes = int(float(config.pop("segment_mb", 512)) * (1 << 20))
        local_buffer_bytes = int(float(config.pop("local_buffer_mb", 16)) * (1 << 20))
        pool_bytes = int(float(config.pop("pool_mb", 256)) * (1 << 20))
        self.ttl_s = float(config.pop("ttl_s", DEFAULT_TTL_S))
        prefer_local = bool(config.pop("prefer_local", True))
        if config:
            raise ValueError(f"mooncake_store connector: unknown options {sorted(config)}")
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, metadata_server, segment_bytes, local_buffer_bytes, protocol,
                               device_name, master)
        if rc != 0:
            raise TransferFailed(f"mooncake_store: setup against master {master} failed (rc={rc})")
        try:
            self._memory = RegisteredPool(pool_bytes, self._store.register_buffer, self._store.unregister_buffer,
                                          "mooncake_store")
        except TransferFailed:
            self._store.close()
            raise
        self._pool = self._memory.pool
        self._replicate = ReplicateConfig()
        if prefer_local:
            self._replicate.preferred_segment = self._store.get_hostname()
        self._lock = threading.Lock()
        self._put_at: collections.OrderedDict[str, float] = collections.OrderedDict()  # keys we put, oldest first
        self._stats = collections.Counter()
        self._reservations_open = 0
        self._last_error: str | None = None
        self._closed = False

    # ------------------------------------------------------------------------------ producer

    def _check_open(self) -> None:
        if self._closed:
            raise TransferFailed("mooncake_store connector is closed")

    def put(self, key: str, payload: Payload) -> Handle:
        self._check_open()
        encode_plan = codec.plan(payload)
        block = self._memory.allocate(encode_plan.size)
        try:
            _write_into(block, encode_plan)
            return self._upsert(key, block, encode_plan.size)
        finally:
            block.release()

    def reserve(self, layout: Layout) -> Reservation:
        """Tensors that are views of a registered block, laid out as ``put_reserved`` will store them."""
        self._check_open()
        reserved = codec.reserve_layout(check_layout(layout))
        memory = self._memory.allocate(reserved.end + EXTRA_DATA_ROOM)
        try:
            tensors = codec.reserved_views(memory.view(reserved.end), reserved)
        except BaseException:
            memory.release()
            raise
        with self._lock:
            self._reservations_open += 1
        return Reservation(tensors, memory=Lent(self, memory, reserved, room=memory.size))

    def _put_lent(self, key: str, lent: Lent, encode_plan: codec.EncodePlan) -> tuple[Handle, bool]:
        self._check_open()
        _write_into(lent.memory, encode_plan)
        # The store copied the block when upsert_from returned: _return_lent may free it then.
        return self._upsert(key, lent.memory, encode_plan.size), False

    def _return_lent(self, lent: Lent, kept: bool) -> None:
        with self._lock:
            self._reservations_open -= 1
        lent.memory.release()

    def _upsert(self, key: str, memory: Block | Region, size: int) -> Handle:
        """Store the first ``size`` bytes of ``memory`` (an encoded payload) under ``key``. The
        store has copied them when this returns; the caller frees ``memory`` only then."""
        self._expire(time.monotonic())
        rc = self._store.upsert_from(key, memory.address, size, self._replicate)
        if rc != 0:
            raise self._failed(f"put of {key!r} ({size} bytes) failed with Mooncake error {rc}")
        with self._lock:
            self._put_at.pop(key, None)
            self._put_at[key] = time.monotonic()
            self._stats["puts"] += 1
            self._stats["bytes_put"] += size
        self._last_error = None
        return {"size": size}

    def _count(self, event: str) -> None:
        with self._lock:
            self._stats[event] += 1

    def _expire(self, now: float) -> None:
        expired = []
        with self._lock:
            while self._put_at:
                key, put_at = next(iter(self._put_at.items()))
                if now - put_at < self.ttl_s:
                    break
                self._put_at.popitem(last=False)
                expired.append(key)
        for key in expired:
            if self._store.remove(key, True) == 0:
                with self._lock:
                    self._stats["expired"] += 1

    # ------------------------------------------------------------------------------ consumer

    def get(self, key: str, handle: Handle | None = None, timeout: float = DEFAULT_GET_TIMEOUT_S) -> Payload:
        self._check_open()
        deadline = time.monotonic() + timeout
        size = handle.get("size") if isinstance(handle, dict) else None
        size = size if isinstance(size, int) and size > 0 else None
        delay, last_rc = 0.0005, OBJECT_NOT_FOUND
        while True:
            if size is None:
                rc = self._store.get_size(key)
                size, last_rc = (rc, OBJECT_NOT_FOUND) if rc > 0 else (None, rc)
            if size is not None:
                payload = self._read(key, size)
                if isinstance(payload, dict):
                    return payload
                size, last_rc = None, payload   # gone or resized since: ask the master again
            if time.monotonic() >= deadline:
                why = "" if last_rc == OBJECT_NOT_FOUND else f" (last Mooncake error {last_rc})"
                raise self._failed(f"key {key!r} not available within {timeout:.1f}s{why}")
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.05)

    def _read(self, key: str, size: int) -> Payload | int:
        """The payload, or Mooncake's (negative) return code."""
        block = self._memory.allocate(size)
        got = self._store.get_into(key, block.address, size)
        if got != size:
            block.release()
            return got if got < 0 else OBJECT_NOT_FOUND
        if isinstance(block, Block):
            array = self._pool.lease(block, nbytes=size)
        else:
            block.release()   # unregistered; the memory lives as long as the tensors
            array = block.array[:size]
        try:
            payload = codec.decode(array)
        except codec.CodecError as exc:
            raise TransferFailed(f"mooncake_store: payload of key {key!r} is corrupt: {exc}") from None
        with self._lock:
            self._stats["gets"] += 1
            self._stats["bytes_got"] += size
        self._last_error = None
        return payload

    def delete(self, key: str) -> None:
        rc = self._store.remove(key, True)
        with self._lock:
            self._put_at.pop(key, None)
            if rc == 0:
                self._stats["deletes"] += 1
        if rc not in (0, OBJECT_NOT_FOUND):
            raise self._failed(f"delete of {key!r} failed with Mooncake error {rc}")

    def _failed(self, message: str) -> TransferFailed:
        self._last_error = f"mooncake_store (master {self.master}): {message}"
        return TransferFailed(self._last_error)

    # ----------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Remove expired keys, leave the store (this client's segment, and what it held, go
        with it). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._expire(time.monotonic())
        self._memory.close()
        self._store.close()

    def health(self) -> dict:
        with self._lock:
            stats = {k: int(v) for k, v in self._stats.items()}
            pending = len(self._put_at)
            reservations = self._reservations_open
        return {"backend": self.name, "ok": not self._closed and self._last_error is None, "master": self.master,
                "last_error": self._last_error, "keys_put_pending": pending, "reservations_open": reservations,
                **self._pool.stats(), **stats}


def _write_into(memory: Block | Region, encode_plan: codec.EncodePlan) -> None:
    """Write an encoded payload (or what a reservation lacks) into the start of ``memory``."""
    view = memory.view(encode_plan.size)
    try:
        codec.write_into(view, encode_plan)
    finally:
        view.release()
