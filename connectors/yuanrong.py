"""``yuanrong`` connector: payloads in an openYuanrong datasystem (``datasystem_worker``, one per
host, sharing a metastore), through its KV client (``pip install 'omnirelay[yuanrong]'``).

One payload is one datasystem key: ``P`` + the key escaped to the store's alphabet (``P`` is the
``prefix`` option). The store accepts 255 characters of ``[A-Za-z0-9-_!@#%^*()+=:;]``, so every
other byte, ``%`` and ``#`` become ``%XX``, and a name still too long becomes its head, ``#`` and a
BLAKE2b digest of the whole key (``#`` appears in no escaped name, so the two forms never meet).

* ``put``: ``mcreate`` a buffer of the encoded size in the worker's shared memory, encode straight
  into it and publish it with ``mset_buffer`` (replacing an older value of the key): the tensors'
  bytes are copied once, into the store. Every key carries the TTL (``ttl_s``, whole seconds), so a
  payload whose consumer never came expires in the worker. Handle: ``{"size": bytes}``.
* In place: the store names a buffer when it creates it and a reservation has no key yet, so
  ``reserve`` lends a block of this connector's encode pool (the fallback of ``connectors/base.py``:
  the memory ``put`` would otherwise encode into); ``put_reserved`` writes the header and the added
  items around the tensors and copies the block into the store as one buffer. (``set`` would take
  the block as it is, but a key written by ``set`` cannot be written again by ``mset_buffer``: the
  store records each key's write path, so both calls use ``mcreate``.)
* ``get``: ``get_read_only_buffers`` until the key exists or the timeout passes (polled, backing
  off to 50 ms: the store's own wait does not wake when another client publishes), then one copy
  out of the worker's shared memory into a block of the receive pool; the tensors are views of that
  block, which is recycled when they die. Key-only retrieval is native (the metastore knows every
  key). With a handle the producer had finished, so a key the store does not hold fails at once.
* ``delete``: ``delete([name])``; a missing key is not an error.

Outages: the client's every call is bounded by ``request_timeout_s`` (its first connect by
``connect_timeout_s``; the library's default for both is 60 s), and a call to a worker that is gone
waits all of it (measured: 10.0 s at 10, 2.0 s at 2). The client holds the GIL through every call
(measured: no other thread of the process ran during a 3 s call to a killed worker, nor during a
0.12 s 64 MiB set), so such a wait stalls the whole worker process, its heartbeats too: the default
of 2 s keeps it under the broker's liveness period (3.5 s). After a call fails for any reason but
"key not found", the connector is *suspect*: each call first checks that the worker's port accepts
a TCP connection (Python's socket, which lets the GIL go, within ``connect_timeout_s``) and fails at
once when it does not, until a call succeeds again. Failures become
:class:`~omnirelay.errors.TransferFailed` naming the worker. ``put`` and ``delete`` fail after one
call; ``get`` keeps trying until its timeout (overrunning it by at most one call). The client
reconnects by itself, so the same connector works again once a worker is back on that address.

Options: ``address`` (required, ``host:port`` of the local ``datasystem_worker``), ``prefix``
(``omnirelay:``), ``ttl_s`` (300), ``connect_timeout_s`` (2), ``request_timeout_s`` (2: raise it for
payloads the host cannot copy in that time, knowing an outage then stalls the process as long),
``pool_mb`` (256: the reused encode/receive buffers). The 2 s default trades the other way too: a
live worker on a loaded host has missed it once (a 7 KB put in the contract suite's concurrency
test), which fails that transfer as any outage does (``transfer_failed``, which the broker retries).
"""

from __future__ import annotations

import collections
import hashlib
import re
import socket
import threading
import time

from omnirelay.errors import TransferFailed

from . import codec
from .base import DEFAULT_GET_TIMEOUT_S, DEFAULT_TTL_S, Connector, Handle, Layout, Lent, Payload, Reservation, check_layout
from .buffers import Block, BufferPool

try:
    from yr.datasystem.kv_client import KVClient
    from yr.datasystem.object_client import WriteMode
except ImportError as exc:  # pragma: no cover - depends on the optional extra
    raise ImportError("the yuanrong connector needs the 'yuanrong' extra: "
                      "pip install 'omnirelay[yuanrong]' (openyuanrong-datasystem)") from exc

MAX_NAME = 255
_PLAIN = re.compile(rb"[A-Za-z0-9\-_!@^*()+=:;]")   # the store's alphabet less % and #, our escapes
_CODE = re.compile(r"code: \[([^\]]*)\]")
NOT_FOUND = "Key not found"

# Block room a reservation keeps after its tensors for the data of ``put_reserved``'s bytes items:
# small ones (token ids, a short blob) then go in place too, for one page per reservation; larger
# ones fall back to a copy.
EXTRA_DATA_ROOM = 4096


def store_name(prefix: str, key: str) -> str:
    """The datasystem key of ``key``: injective, within the store's alphabet and length."""
    escaped = "".join(chr(b) if _PLAIN.fullmatch(bytes([b])) else f"%{b:02X}" for b in (prefix + key).encode())
    if len(escaped) <= MAX_NAME:
        return escaped
    digest = hashlib.blake2b((prefix + key).encode(), digest_size=16).hexdigest()
    return f"{escaped[:MAX_NAME - len(digest) - 1]}#{digest}"


def _code(exc: Exception) -> str:
    """The datasystem status code of a client error (``Key not found``, ``RPC unavailable``, …)."""
    found = _CODE.search(str(exc))
    return found.group(1) if found else type(exc).__name__


def _short(exc: Exception) -> str:
    """The first line of a datasystem error (the rest is its source location and trace id)."""
    return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__


class YuanrongConnector(Connector):
    name = "yuanrong"

    def __init__(self, config: dict | None = None):
        config = dict(config or {})
        address = config.pop("address", None)
        if not isinstance(address, str) or ":" not in address:
            raise ValueError("yuanrong connector: option 'address' (host:port of the local datasystem_worker) "
                             "is required")
        host, _, port = address.rpartition(":")
        self.address, self._endpoint = address, (host, int(port))
        self.prefix = str(config.pop("prefix", "omnirelay:"))
        self.ttl_s = max(1, int(-(-float(config.pop("ttl_s", DEFAULT_TTL_S)) // 1)))
        connect_ms = max(1, int(float(config.pop("connect_timeout_s", 2.0)) * 1000))
        request_ms = max(1, int(float(config.pop("request_timeout_s", 2.0)) * 1000))
        pool_bytes = int(float(config.pop("pool_mb", 256)) * (1 << 20))
        if config:
            raise ValueError(f"yuanrong connector: unknown options {sorted(config)}")
        self._connect_s = connect_ms / 1000
        self._client = KVClient(host, int(port), connect_timeout_ms=connect_ms, req_timeout_ms=request_ms)
        try:
            self._client.init()
        except (RuntimeError, TypeError) as exc:
            raise TransferFailed(f"yuanrong: cannot connect to the datasystem worker at {address} within "
                                 f"{connect_ms / 1000:.1f}s: {_short(exc)}") from None
        self._pool = BufferPool(pool_bytes) if pool_bytes > 0 else None
        self._lock = threading.Lock()
        self._stats = collections.Counter()
        self._reservations_open = 0
        self._last_error: str | None = None
        self._suspect = False   # the last call failed: check the worker's port before the next one
        self._closed = False

    # ------------------------------------------------------------------------------ helpers

    def _call(self, fn, *args):
        """``fn(*args)`` on the client (it holds the GIL throughout: see "Outages"). A suspect
        worker whose port refuses, or does not answer within ``connect_timeout_s``, fails here
        without entering the client."""
        if self._suspect:
            try:
                socket.create_connection(self._endpoint, timeout=self._connect_s).close()
            except OSError as exc:
                raise RuntimeError(f"code: [Unreachable], msg: [port closed: {exc}]") from None
        try:
            result = fn(*args)
        except RuntimeError as exc:
            self._suspect = _code(exc) != NOT_FOUND
            raise
        self._suspect = False
        return result

    def _client_or_fail(self) -> KVClient:
        client = self._client
        if self._closed or client is None:
            raise TransferFailed("yuanrong connector is closed")
        return client

    def _failed(self, what: str, exc: Exception) -> TransferFailed:
        message = f"yuanrong worker at {self.address} failed during {what}: {_short(exc)}"
        self._last_error = message
        return TransferFailed(message)

    def _buffer(self, size: int) -> tuple[Block | None, memoryview]:
        """A writable buffer of ``size`` bytes: a pool block, or a fresh bytearray (block None)
        when there is no pool or it is full."""
        block = self._pool.allocate(size) if self._pool is not None else None
        return block, block.view(size) if block is not None else memoryview(bytearray(size))

    def _count(self, event: str, n: int = 1) -> None:
        with self._lock:
            self._stats[event] += n

    # ------------------------------------------------------------------------------ producer

    def put(self, key: str, payload: Payload) -> Handle:
        client = self._client_or_fail()
        encode_plan = codec.plan(payload)
        return self._publish(client, key, encode_plan.size, lambda view: codec.write_into(view, encode_plan))

    def reserve(self, layout: Layout) -> Reservation:
        """Tensors that are views of an encode-pool block, laid out as ``put_reserved`` will send them."""
        self._client_or_fail()
        reserved = codec.reserve_layout(check_layout(layout))
        block, view = self._buffer(reserved.end + EXTRA_DATA_ROOM)
        try:
            tensors = codec.reserved_views(view, reserved)
        except BaseException:
            if block is not None:
                block.release()
            raise
        with self._lock:
            self._reservations_open += 1
        return Reservation(tensors, memory=Lent(self, (block, view), reserved, room=view.nbytes))

    def _put_lent(self, key: str, lent: Lent, encode_plan: codec.EncodePlan) -> tuple[Handle, bool]:
        client = self._client_or_fail()
        _, view = lent.memory
        codec.write_into(view, encode_plan)

        def fill(store: memoryview) -> None:
            store[:] = view[:encode_plan.size]
        return self._publish(client, key, encode_plan.size, fill), False   # the store holds its own copy now

    def _return_lent(self, lent: Lent, kept: bool) -> None:
        with self._lock:
            self._reservations_open -= 1
        block, _ = lent.memory   # the view stays: tensors the caller has not dropped still export it
        if block is not None:
            block.release()

    def _publish(self, client: KVClient, key: str, size: int, fill) -> Handle:
        """Create ``size`` bytes of the worker's memory for ``key``, ``fill`` them, publish them."""
        name = store_name(self.prefix, key)
        try:
            buffer = self._call(client.mcreate, [name], [size], WriteMode.NONE_L2_CACHE, self.ttl_s)[0]
        except RuntimeError as exc:
            raise self._failed(f"put of {key!r} ({size} bytes)", exc) from None
        store = memoryview(buffer.MutableData())
        try:
            fill(store)
        finally:
            store.release()
        try:
            self._call(client.mset_buffer, [buffer])
        except RuntimeError as exc:
            raise self._failed(f"put of {key!r} ({size} bytes)", exc) from None
        self._last_error = None
        with self._lock:
            self._stats["puts"] += 1
            self._stats["bytes_put"] += size
        return {"size": size}

    # ------------------------------------------------------------------------------ consumer

    def get(self, key: str, handle: Handle | None = None, timeout: float = DEFAULT_GET_TIMEOUT_S) -> Payload:
        client = self._client_or_fail()
        name = store_name(self.prefix, key)
        deadline = time.monotonic() + timeout
        delay, last_error = 0.0005, None
        while True:
            # The store's own wait for a key (its timeout argument) does not wake when another
            # client publishes the key (measured: a 20 s wait ran out 20 s later), so ask without
            # waiting and back off here. A handle says the producer had finished: a store that
            # answers without the key lost it (expired, evicted, its worker restarted empty).
            try:
                found = self._call(client.get_read_only_buffers, [name], 0)[0]
                if found is not None:
                    self._last_error = None
                    return self._copy_out(key, found)
                last_error = None
            except RuntimeError as exc:
                if _code(exc) != NOT_FOUND:
                    last_error = self._failed(f"get of {key!r}", exc)
                elif handle is not None and last_error is None:
                    raise TransferFailed(f"yuanrong: key {key!r} is gone (it had been written; the store "
                                         f"at {self.address} no longer holds it)") from None
                else:
                    last_error = None
            if time.monotonic() >= deadline:
                if last_error is not None:
                    raise TransferFailed(f"{last_error} (gave up after {timeout:.1f}s)")
                raise TransferFailed(f"yuanrong: key {key!r} not available within {timeout:.1f}s")
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.05)

    def _copy_out(self, key: str, found) -> Payload:
        """Copy a read-only view of the worker's memory into a receive block and decode it there."""
        source = found.immutable_data()
        size = source.nbytes
        block = self._pool.allocate(size) if self._pool is not None else None
        buffer = self._pool.lease(block, nbytes=size) if block is not None else bytearray(size)
        target = memoryview(buffer).cast("B")
        target[:] = source
        target.release()
        source.release()
        try:
            payload = codec.decode(buffer)
        except codec.CodecError as exc:
            raise TransferFailed(f"yuanrong: payload of key {key!r} is corrupt: {exc}") from None
        with self._lock:
            self._stats["gets"] += 1
            self._stats["bytes_got"] += size
        return payload

    def delete(self, key: str) -> None:
        client = self._client_or_fail()
        try:
            failed = self._call(client.delete, [store_name(self.prefix, key)])
        except RuntimeError as exc:
            if _code(exc) == NOT_FOUND:
                return
            raise self._failed(f"delete of {key!r}", exc) from None
        if failed:
            raise TransferFailed(f"yuanrong worker at {self.address}: delete of {key!r} failed")
        self._last_error = None
        self._count("deletes")

    # ----------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Drop the client (its connection closes with it). Payloads stay in the store until
        deleted or expired. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._client = None

    def health(self) -> dict:
        """Never touches the network: ``ok`` reflects the last operation's outcome."""
        with self._lock:
            stats = {k: int(v) for k, v in self._stats.items()}
            reservations = self._reservations_open
        return {"backend": self.name, "ok": not self._closed and self._last_error is None,
                "worker": self.address, "last_error": self._last_error, "reservations_open": reservations,
                **(self._pool.stats() if self._pool is not None else {}), **stats}
