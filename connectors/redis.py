"""``redis`` connector: payloads in a Redis server, for stages on different hosts without RDMA.

Layout of one payload under key ``K`` (``P`` is the ``prefix`` option)::

    P K              meta: msgpack {"g": generation, "n": chunks, "s": bytes}   written last
    P K #<g>:<i>     chunk i of the encoded payload (``chunk_mb`` each)           written first

A ``put`` encodes into a reused buffer and sends every chunk and then the meta in one pipeline
(one round trip; the chunks go to the socket straight from the buffer, see
:class:`_ZeroCopyPacker`). Because the meta is written after the chunks, a consumer that sees the
meta sees the whole payload; because chunk names carry the generation, a ``put`` again under the
same key never tears a concurrent reader's payload (the old chunks are unlinked afterwards). Every
key gets the TTL (``ttl_s``), so a payload whose consumer never came, or whose producer died
mid-write, expires on its own.

In place: ``reserve`` lends tensors that are views of such an encode buffer (with room after them
for small added items); ``put_reserved`` writes only the header and the added items around them and
sends the buffer exactly as ``put`` does, so the tensors' bytes are copied once, onto the socket.

A ``get`` reads the meta (or takes it from the handle), fetches every chunk in one pipeline and
assembles them into a pooled buffer; the tensors it returns are views into that buffer, which is
recycled when they die. ``delete`` unlinks the meta and the chunks.

Outages: any connection error becomes :class:`~omnirelay.errors.TransferFailed` naming the server;
``put`` and ``delete`` fail after one connection attempt and one retry, ``get`` keeps trying until
its timeout (overrunning it by at most one attempt: ``connect_timeout_s`` when packets are dropped
rather than refused). redis-py reconnects by itself, so the same connector works again as soon as
the server is back.

Options: ``url`` (default ``redis://127.0.0.1:6379/0``), ``prefix`` (``omnirelay:``), ``ttl_s``
(300), ``chunk_mb`` (1), ``socket_timeout_s`` (10: the longest one command may block),
``connect_timeout_s`` (2), ``pool_mb`` (256: the reused encode/receive buffers),
``max_connections`` (32).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time

import msgpack
import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from omnirelay.errors import TransferFailed

from . import codec
from .base import DEFAULT_GET_TIMEOUT_S, DEFAULT_TTL_S, Connector, Handle, Layout, Lent, Payload, Reservation, check_layout
from .buffers import Block, BufferPool

_CUTOFF = 6000   # arguments longer than this are sent as their own buffer, never copied

# Buffer room a reservation keeps after its tensors for the data of ``put_reserved``'s bytes items:
# small ones (token ids, a short blob) then go in place too, for one page per reservation; larger
# ones fall back to a copy.
EXTRA_DATA_ROOM = 4096


class _ZeroCopyPacker:
    """RESP command packer that passes large arguments through untouched.

    redis-py's hiredis packer copies every argument into one new ``bytes`` (twice for a
    memoryview), which for a 64 MiB payload means two copies into fresh, slow-to-touch memory.
    This one returns the large arguments themselves; the connection sends them with ``sendall``.
    """

    def pack(self, *args) -> list:
        # A command name of several words ("CONFIG GET") goes out as separate arguments.
        if isinstance(args[0], str):
            args = tuple(args[0].encode().split()) + args[1:]
        elif b" " in args[0]:
            args = tuple(args[0].split()) + args[1:]
        output: list = []
        head = [b"*%d\r\n" % len(args)]
        for arg in args:
            if isinstance(arg, str):
                arg = arg.encode()
            elif isinstance(arg, (int, float)) and not isinstance(arg, bool):
                arg = repr(arg).encode()
            elif not isinstance(arg, (bytes, bytearray, memoryview)):
                raise redis.DataError(f"cannot send a {type(arg).__name__} to redis")
            n = arg.nbytes if isinstance(arg, memoryview) else len(arg)
            head.append(b"$%d\r\n" % n)
            if n > _CUTOFF or isinstance(arg, memoryview):
                output.append(b"".join(head))
                output.append(arg)
                head = [b"\r\n"]
            else:
                head.append(arg)
                head.append(b"\r\n")
        output.append(b"".join(head))
        return output


@dataclasses.dataclass(eq=False)
class _EncodeBuffer:
    """A reservation's encode buffer: its pool block (None for a one-off buffer) and the writable
    view its tensors are views of."""
    block: Block | None
    view: memoryview


class RedisConnector(Connector):
    name = "redis"

    def __init__(self, config: dict | None = None):
        config = dict(config or {})
        self.url = str(config.pop("url", "redis://127.0.0.1:6379/0"))
        self.prefix = str(config.pop("prefix", "omnirelay:")).encode()
        self.ttl_ms = max(1, int(float(config.pop("ttl_s", DEFAULT_TTL_S)) * 1000))
        self.chunk_bytes = max(64 * 1024, int(float(config.pop("chunk_mb", 1)) * (1 << 20)))
        socket_timeout = float(config.pop("socket_timeout_s", 10.0))
        connect_timeout = float(config.pop("connect_timeout_s", 2.0))
        pool_bytes = int(float(config.pop("pool_mb", 256)) * (1 << 20))
        max_connections = int(config.pop("max_connections", 32))
        if config:
            raise ValueError(f"redis connector: unknown options {sorted(config)}")
        self._client = redis.Redis.from_url(
            self.url, socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=1), max_connections=max_connections,
            command_packer=_ZeroCopyPacker(), health_check_interval=0)
        self._where = self._client.connection_pool.connection_kwargs.get("host", "?")
        self._where = f"{self._where}:{self._client.connection_pool.connection_kwargs.get('port', '?')}"
        self._pool = BufferPool(pool_bytes) if pool_bytes > 0 else None
        self._gen_lock = threading.Lock()
        self._gen = 0
        self._lock = threading.Lock()
        self._stats = collections.Counter()
        self._reservations_open = 0
        self._last_error: str | None = None
        self._closed = False

    # ------------------------------------------------------------------------------ helpers

    def _meta_key(self, key: str) -> bytes:
        return self.prefix + key.encode()

    def _chunk_keys(self, key: str, gen: str, n: int) -> list[bytes]:
        base = self.prefix + key.encode() + b"#" + gen.encode() + b":"
        return [base + str(i).encode() for i in range(n)]

    def _next_gen(self) -> str:
        with self._gen_lock:
            self._gen += 1
            return f"{os.getpid():x}.{id(self) & 0xffff:x}.{self._gen:x}"

    def _failed(self, what: str, exc: Exception) -> TransferFailed:
        message = f"redis at {self._where} unreachable during {what}: {type(exc).__name__}: {exc}"
        self._last_error = message
        return TransferFailed(message)

    def _ok(self) -> None:
        self._last_error = None

    # ------------------------------------------------------------------------------ producer

    def _check_open(self) -> None:
        if self._closed:
            raise TransferFailed("redis connector is closed")

    def _encode_buffer(self, size: int) -> tuple[Block | None, memoryview]:
        """A writable buffer of ``size`` bytes to encode into: a pool block, or a fresh bytearray
        (block None) when there is no pool or it is full."""
        block = self._pool.allocate(size) if self._pool is not None else None
        return block, block.view(size) if block is not None else memoryview(bytearray(size))

    def put(self, key: str, payload: Payload) -> Handle:
        self._check_open()
        encode_plan = codec.plan(payload)
        block, view = self._encode_buffer(encode_plan.size)
        try:
            codec.write_into(view, encode_plan)
            return self._send(key, view)
        finally:
            view.release()
            if block is not None:
                block.release()

    def reserve(self, layout: Layout) -> Reservation:
        """Tensors that are views of an encode buffer, laid out as ``put_reserved`` will send them."""
        self._check_open()
        reserved = codec.reserve_layout(check_layout(layout))
        block, view = self._encode_buffer(reserved.end + EXTRA_DATA_ROOM)
        try:
            tensors = codec.reserved_views(view, reserved)
        except BaseException:
            if block is not None:
                block.release()
            raise
        with self._lock:
            self._reservations_open += 1
        return Reservation(tensors, memory=Lent(self, _EncodeBuffer(block, view), reserved, room=view.nbytes))

    def _put_lent(self, key: str, lent: Lent, encode_plan: codec.EncodePlan) -> tuple[Handle, bool]:
        self._check_open()
        view = lent.memory.view
        codec.write_into(view, encode_plan)
        return self._send(key, view[:encode_plan.size]), False   # Redis holds its own copy now

    def _return_lent(self, lent: Lent, kept: bool) -> None:
        with self._lock:
            self._reservations_open -= 1
        # The view stays as it is: tensors the caller has not dropped yet still export it.
        if lent.memory.block is not None:
            lent.memory.block.release()

    def _send(self, key: str, encoded: memoryview) -> Handle:
        """Send an encoded payload as chunks, then its meta, in one pipeline; unlink the chunks of
        the value it replaced. ``encoded`` is only read, and only until this returns."""
        size = encoded.nbytes
        gen = self._next_gen()
        n = max(1, -(-size // self.chunk_bytes))
        meta = msgpack.packb({"g": gen, "n": n, "s": size})
        pipe = self._client.pipeline(transaction=False)
        for i, chunk_key in enumerate(self._chunk_keys(key, gen, n)):
            pipe.set(chunk_key, encoded[i * self.chunk_bytes: (i + 1) * self.chunk_bytes], px=self.ttl_ms)
        pipe.set(self._meta_key(key), meta, px=self.ttl_ms, get=True)
        try:
            replies = pipe.execute()
        except redis.RedisError as exc:
            raise self._failed(f"put of {key!r}", exc) from None
        self._ok()
        previous = replies[-1]
        if previous:
            self._unlink_chunks(key, previous, keep_gen=gen)
        with self._lock:
            self._stats["puts"] += 1
            self._stats["bytes_put"] += size
        return {"g": gen, "n": n, "s": size}

    def _count(self, event: str) -> None:
        with self._lock:
            self._stats[event] += 1

    def _unlink_chunks(self, key: str, meta_bytes: bytes, keep_gen: str | None = None) -> None:
        """Best effort: the TTL collects whatever this misses."""
        meta = _parse_meta(meta_bytes)
        if meta is None or meta["g"] == keep_gen:
            return
        try:
            self._client.unlink(*self._chunk_keys(key, meta["g"], meta["n"]))
        except redis.RedisError:
            pass

    # ------------------------------------------------------------------------------ consumer

    def get(self, key: str, handle: Handle | None = None, timeout: float = DEFAULT_GET_TIMEOUT_S) -> Payload:
        deadline = time.monotonic() + timeout
        meta = _parse_meta(handle) if isinstance(handle, dict) else None
        delay, last_error = 0.0005, None
        while True:
            try:
                if meta is None:
                    meta = _parse_meta(self._client.get(self._meta_key(key)))
                    if meta is None and handle is not None and last_error is None:
                        # The producer had finished (it gave the handle) and Redis answers without
                        # the key: the store lost it (restarted empty, evicted). Waiting cannot bring
                        # it back, and a consumer blocked here stalls every other request it serves.
                        raise TransferFailed(f"redis: key {key!r} is gone (it had been written; the store lost it)")
                if meta is not None:
                    chunks = self._fetch(key, meta)
                    if chunks is not None:
                        self._ok()
                        return self._assemble(key, meta, chunks)
                    meta = None   # the handle (or the meta we read) went stale: look again
                last_error = None
            except redis.RedisError as exc:
                last_error = self._failed(f"get of {key!r}", exc)
            if time.monotonic() >= deadline:
                if last_error is not None:
                    raise TransferFailed(f"{last_error} (gave up after {timeout:.1f}s)")
                raise TransferFailed(f"redis: key {key!r} not available within {timeout:.1f}s")
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.05)

    def _fetch(self, key: str, meta: dict) -> list[bytes] | None:
        pipe = self._client.pipeline(transaction=False)
        for chunk_key in self._chunk_keys(key, meta["g"], meta["n"]):
            pipe.get(chunk_key)
        chunks = pipe.execute()
        if any(c is None for c in chunks) or sum(len(c) for c in chunks) != meta["s"]:
            return None
        return chunks

    def _assemble(self, key: str, meta: dict, chunks: list[bytes]):
        size = meta["s"]
        block = self._pool.allocate(size) if self._pool is not None else None
        buffer = self._pool.lease(block, nbytes=size) if block is not None else bytearray(size)
        view = memoryview(buffer).cast("B")
        offset = 0
        for chunk in chunks:
            view[offset: offset + len(chunk)] = chunk
            offset += len(chunk)
        view.release()
        try:
            payload = codec.decode(buffer)
        except codec.CodecError as exc:
            raise TransferFailed(f"redis: payload of key {key!r} is corrupt: {exc}") from None
        with self._lock:
            self._stats["gets"] += 1
            self._stats["bytes_got"] += size
        return payload

    def delete(self, key: str) -> None:
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.get(self._meta_key(key))
            pipe.unlink(self._meta_key(key))
            meta_bytes, _ = pipe.execute()
        except redis.RedisError as exc:
            raise self._failed(f"delete of {key!r}", exc) from None
        self._ok()
        if meta_bytes:
            self._unlink_chunks(key, meta_bytes)
            with self._lock:
                self._stats["deletes"] += 1

    # ----------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close the connections. Payloads stay in Redis until deleted or expired. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._client.close()
        self._client.connection_pool.disconnect()

    def health(self) -> dict:
        """Never touches the network: ``ok`` reflects the last operation's outcome."""
        with self._lock:
            stats = {k: int(v) for k, v in self._stats.items()}
            reservations = self._reservations_open
        return {"backend": self.name, "ok": not self._closed and self._last_error is None,
                "server": self._where, "last_error": self._last_error, "reservations_open": reservations,
                **(self._pool.stats() if self._pool is not None else {}), **stats}


def _parse_meta(raw) -> dict | None:
    """A validated meta map (from Redis bytes or from a handle), or None."""
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = msgpack.unpackb(raw, raw=False)
        except Exception:  # noqa: BLE001 - a corrupt meta is the same as a missing one
            return None
    if (isinstance(raw, dict) and isinstance(raw.get("g"), str) and isinstance(raw.get("n"), int)
            and isinstance(raw.get("s"), int) and 0 < raw["n"] <= 1 << 20 and raw["s"] >= 0):
        return raw
    return None
