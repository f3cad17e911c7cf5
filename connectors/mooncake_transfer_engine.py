"""``mooncake_transfer_engine`` connector: the consumer reads the payload out of the producer's
memory with Mooncake's transfer engine (RDMA where the hardware is, TCP here), peer to peer.

Each connector starts one ``mooncake.engine.TransferEngine`` in ``P2PHANDSHAKE`` mode (no metadata
server: peers address each other as ``ip:rpc_port``) and registers one :class:`BufferPool` with it,
once. That pool holds both the payloads this process produced and the ones it received.

The life of one payload::

    producer put:  encode into a pool block behind a 64-byte header → publish (header generation,
                   directory entry) → handle {"peer", "addr", "size", "gen"}
    consumer get:  read header + payload from (peer, addr) into its own pool block → check the
                   header (magic, generation, not yet acknowledged) → read the generation again
                   (a seqlock: a block the producer recycled meanwhile is detected) → decode views
    consumer delete: write the generation into the header's ``acked`` word on the producer
    producer (next put): recycle acknowledged blocks and blocks older than ``ttl_s``

Header layout (little-endian): ``magic u64 | gen u64 | size u64 | acked u64 | key hash 16 B``.
``gen`` is 0 while the block is being written or after it was recycled.

Key-only retrieval uses a **directory** of entries, ``<directory>/omnirelay-<pid>-<key hash>``:
symlinks that are never followed, whose target text ``<peer>@<addr>@<size>@<gen>`` is the handle
(one ``symlink`` to publish, one ``readlink`` to look up); the key hash in the block header guards
against a colliding name. A directory on the local tmpfs serves one host; a shared directory, or
the handles the broker carries, serve several. Entries of dead producers are swept when a
connector starts and when it closes.

Per-transfer costs kept small: a put recycles acknowledged blocks *before* it allocates, so the
block just freed is written again while it is still in the cache; checking the ``acked`` words
costs one memory read per payload in flight, so with many in flight that check runs once per
``n // 8`` puts (and whenever the pool runs out); a consumer's delete finds the producer's entry
from the handle (it names the producer's ``pid``) instead of scanning the directory.

The payload lives in the producer's memory: once the producer's connector is closed (or its
process dies), payloads nobody fetched are gone and a ``get`` fails with ``TransferFailed``.

Security: the engine's handshake and TCP transport listen on all interfaces (Mooncake chooses
that; ``local_hostname`` only sets the address peers are told), and any peer that reaches them may
read or write the registered pool by address, as with RDMA. Run it on a trusted network only, or
firewall its ports; payloads are not authenticated beyond the key-hash check in the header.

Options: ``local_hostname`` (default 127.0.0.1: the address peers use to reach this process),
``metadata_server`` (``P2PHANDSHAKE``), ``protocol`` (``tcp``; ``rdma`` with ``device_name``),
``device_name`` (""), ``pool_mb`` (256), ``ttl_s`` (300), ``directory``
(``/dev/shm/omnirelay-mooncake``).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import hashlib
import itertools
import os
import struct
import threading
import time

from omnirelay.errors import TransferFailed

from . import codec
from .base import DEFAULT_GET_TIMEOUT_S, DEFAULT_TTL_S, Connector, Handle, Payload
from .buffers import Block, Region
from .mooncake_pool import RegisteredPool

try:
    from mooncake.engine import TransferEngine
except ImportError as exc:  # pragma: no cover - depends on the optional extra
    raise ImportError("the mooncake_transfer_engine connector needs the 'mooncake' extra: "
                      "pip install 'omnirelay[mooncake]' (and Debian libibverbs1)") from exc

HEADER = struct.Struct("<QQQQ16s16x")   # magic, gen, size, acked, key hash; 64 bytes
MAGIC = 0x594C4552494E4D4F               # "OMNIRELY"
_GEN_AT, _ACKED_AT = 8, 24
DEFAULT_DIRECTORY = "/dev/shm/omnirelay-mooncake"
PREFIX = "omnirelay-"


def _key_hash(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def sweep_directory(directory: str) -> int:
    """Remove directory entries whose producer process is dead; returns how many."""
    removed = 0
    for path in glob.glob(os.path.join(glob.escape(directory), PREFIX + "*")):
        head = os.path.basename(path)[len(PREFIX):].split("-", 1)[0]
        if head.isdigit() and len(head) <= 10 and not _pid_alive(int(head)):
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


@dataclasses.dataclass(eq=False)
class _Published:
    key: str
    gen: int
    size: int
    memory: Block | Region
    entry: str
    put_at: float


class MooncakeTEConnector(Connector):
    name = "mooncake_transfer_engine"

    def __init__(self, config: dict | None = None):
        config = dict(config or {})
        self.local_hostname = str(config.pop("local_hostname", "127.0.0.1"))
        metadata_server = str(config.pop("metadata_server", "P2PHANDSHAKE"))
        protocol = str(config.pop("protocol", "tcp"))
        device_name = str(config.pop("device_name", ""))
        pool_bytes = int(float(config.pop("pool_mb", 256)) * (1 << 20))
        self.ttl_s = float(config.pop("ttl_s", DEFAULT_TTL_S))
        self.directory = str(config.pop("directory", DEFAULT_DIRECTORY))
        if config:
            raise ValueError(f"mooncake_transfer_engine connector: unknown options {sorted(config)}")
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        sweep_directory(self.directory)
        self._engine = TransferEngine()
        rc = self._engine.initialize(self.local_hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise TransferFailed(f"mooncake: transfer engine failed to initialize (rc={rc}) on "
                                 f"{self.local_hostname} with {protocol} via {metadata_server}")
        self.peer = f"{self.local_hostname}:{self._engine.get_rpc_port()}"
        self._memory = RegisteredPool(pool_bytes, self._engine.register_memory, self._engine.unregister_memory,
                                      "mooncake_transfer_engine")
        self._pool = self._memory.pool
        self._pid = os.getpid()
        self._gens = itertools.count(1)
        self._lock = threading.Lock()
        self._published: dict[int, _Published] = {}               # gen → payload we hold
        self._by_key: dict[str, int] = {}                          # key → its current gen
        self._recent: collections.OrderedDict[str, dict] = collections.OrderedDict()  # key → handle got
        self._stats = collections.Counter()
        self._since_reclaim = 0
        self._closed = False

    # ------------------------------------------------------------------------------ memory

    def _allocate(self, size: int) -> Block | Region:
        block = self._pool.allocate(size)
        if block is not None:
            return block
        self._reclaim(time.monotonic(), force=True)   # acknowledged blocks may free enough
        return self._memory.allocate(size)

    def _entry_path(self, key: str, pid: int | None = None) -> str:
        return os.path.join(self.directory, f"{PREFIX}{pid or self._pid}-{_key_hash(key).hex()}")

    # ------------------------------------------------------------------------------ producer

    def put(self, key: str, payload: Payload) -> Handle:
        if self._closed:
            raise TransferFailed("mooncake_transfer_engine connector is closed")
        encode_plan = codec.plan(payload)
        size = encode_plan.size
        self._reclaim(time.monotonic())
        memory = self._allocate(HEADER.size + size)
        view = memory.view(HEADER.size + size)
        try:
            HEADER.pack_into(view, 0, MAGIC, 0, size, 0, _key_hash(key))
            codec.write_into(view[HEADER.size:], encode_plan)
            gen = next(self._gens)
            struct.pack_into("<Q", view, _GEN_AT, gen)   # readable from here on
        except BaseException:
            view.release()
            memory.release()
            raise
        view.release()
        handle = {"peer": self.peer, "addr": memory.address, "size": size, "gen": gen, "pid": self._pid}
        entry = self._entry_path(key)
        target = _entry_target(handle)
        with self._lock:
            try:
                os.symlink(target, entry)   # the usual case: the key is new
            except FileExistsError:         # put again: replace the entry atomically
                tmp = f"{entry}.{threading.get_ident()}.tmp"
                _unlink(tmp)
                os.symlink(target, tmp)
                os.rename(tmp, entry)
            previous = self._by_key.get(key)
            if previous is not None:
                self._free(self._published.pop(previous), unlink=False)
            self._published[gen] = _Published(key, gen, size, memory, entry, time.monotonic())
            self._by_key[key] = gen
            self._stats["puts"] += 1
            self._stats["bytes_put"] += size
        return handle

    def _free(self, item: _Published, *, unlink: bool) -> None:
        """Recycle a published block (caller holds the lock). Zeroing ``gen`` first makes any
        reader that still has the handle fail its check instead of reading the next payload."""
        view = item.memory.view(HEADER.size)
        struct.pack_into("<Q", view, _GEN_AT, 0)
        view.release()
        item.memory.release()
        if self._by_key.get(item.key) == item.gen:
            del self._by_key[item.key]
            if unlink:
                _remove_entry(item.entry, {"peer": self.peer, "gen": item.gen})

    def _reclaim(self, now: float, force: bool = False) -> None:
        """Recycle payloads their consumer acknowledged, and those older than the TTL. With many
        payloads in flight, only every ``n // 8`` calls unless ``force`` (amortised cost)."""
        with self._lock:
            self._since_reclaim += 1
            if not force and len(self._published) > 8 and self._since_reclaim * 8 < len(self._published):
                return
            self._since_reclaim = 0
            for gen, item in list(self._published.items()):
                view = item.memory.view(HEADER.size)
                (acked,) = struct.unpack_from("<Q", view, _ACKED_AT)
                view.release()
                expired = now - item.put_at >= self.ttl_s
                if acked == gen or expired:
                    del self._published[gen]
                    self._free(item, unlink=True)
                    self._stats["expired" if acked != gen else "acknowledged"] += 1

    # ------------------------------------------------------------------------------ consumer

    def _entries(self, key: str) -> list[tuple[str, dict]]:
        """Directory entries for ``key``: (path, handle) pairs (a directory scan: no pattern is
        compiled per key)."""
        suffix = f"-{_key_hash(key).hex()}"
        try:
            with os.scandir(self.directory) as it:
                paths = [e.path for e in it if e.name.startswith(PREFIX) and e.name.endswith(suffix)]
        except OSError:
            return []
        found = []
        for path in paths:
            entry = _read_entry(path)
            if entry is not None:
                found.append((path, entry))
        return found

    def _lookup(self, key: str) -> dict | None:
        entries = self._entries(key)
        return entries[0][1] if entries else None

    def get(self, key: str, handle: Handle | None = None, timeout: float = DEFAULT_GET_TIMEOUT_S) -> Payload:
        if self._closed:
            raise TransferFailed("mooncake_transfer_engine connector is closed")
        deadline = time.monotonic() + timeout
        current = handle if _valid_handle(handle) else None
        delay, last_problem = 0.0005, ""
        while True:
            if current is None:
                current = self._lookup(key)
            if current is not None:
                result = self._read(key, current)
                if isinstance(result, str):
                    last_problem, current = result, None   # stale or unreachable: look again
                else:
                    with self._lock:
                        self._recent[key] = dict(current)
                        while len(self._recent) > 4096:
                            self._recent.popitem(last=False)
                        self._stats["gets"] += 1
                        self._stats["bytes_got"] += current["size"]
                    return result
            if time.monotonic() >= deadline:
                why = f" (last attempt: {last_problem})" if last_problem else ""
                raise TransferFailed(f"mooncake_transfer_engine: key {key!r} not available within "
                                     f"{timeout:.1f}s{why}")
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.05)

    def _read(self, key: str, handle: dict) -> Payload | str:
        """The payload, or a string saying why this handle did not work."""
        peer, addr, size, gen = handle["peer"], handle["addr"], handle["size"], handle["gen"]
        total = HEADER.size + size
        memory = self._allocate(total)
        leased = False
        try:
            if self._engine.transfer_sync_read(peer, memory.address, addr, total) != 0:
                return f"read from {peer} failed (peer gone or payload recycled)"
            view = memory.view(HEADER.size)
            magic, got_gen, got_size, acked, key_hash = HEADER.unpack_from(view, 0)
            view.release()
            if magic != MAGIC or got_gen != gen or got_size != size or acked == gen or key_hash != _key_hash(key):
                return "payload was deleted or replaced"
            # Seqlock: the generation must not have changed while we copied the payload.
            if self._engine.transfer_sync_read(peer, memory.address, addr, HEADER.size) != 0:
                return f"read from {peer} failed"
            view = memory.view(HEADER.size)
            still = struct.unpack_from("<Q", view, _GEN_AT)[0]
            view.release()
            if still != gen:
                return "payload was recycled during the read"
            if isinstance(memory, Block):
                payload_bytes = self._pool.lease(memory, HEADER.size, size)
            else:
                memory.release()   # unregister now; the memory itself lives as long as the tensors
                payload_bytes = memory.array[HEADER.size:]
            leased = True
            try:
                return codec.decode(payload_bytes)
            except codec.CodecError as exc:
                raise TransferFailed(f"mooncake_transfer_engine: payload of key {key!r} is corrupt: {exc}") from None
        finally:
            if not leased:
                memory.release()

    def delete(self, key: str) -> None:
        with self._lock:
            handle = self._recent.pop(key, None)
            local_gen = self._by_key.get(key)
            if local_gen is not None:   # we produced it ourselves
                item = self._published.pop(local_gen)
                self._free(item, unlink=True)
                self._stats["deletes"] += 1
                return
        if handle is not None and isinstance(handle.get("pid"), int):   # the usual case: we got it
            entries = [(self._entry_path(key, handle["pid"]), handle)]
        else:
            entries = self._entries(key)
            if handle is None and entries:
                handle = entries[0][1]
        if handle is None:
            return
        self._acknowledge(handle)
        for path, entry in entries:
            if entry["peer"] == handle["peer"] and entry["gen"] == handle["gen"]:
                _remove_entry(path, entry)
        with self._lock:
            self._stats["deletes"] += 1

    def _acknowledge(self, handle: dict) -> None:
        """Tell the producer it may recycle the block: write ``gen`` into its ``acked`` word."""
        scratch = self._allocate(8)
        try:
            view = scratch.view(8)
            struct.pack_into("<Q", view, 0, handle["gen"])
            view.release()
            # A failure means the producer is gone, and with it the payload: nothing to free.
            self._engine.transfer_sync_write(handle["peer"], scratch.address, handle["addr"] + _ACKED_AT, 8)
        finally:
            scratch.release()

    # ----------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Withdraw this producer's payloads (they live in its memory), release the engine.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for item in list(self._published.values()):
                self._free(item, unlink=True)
            self._published.clear()
        self._memory.close()
        self._engine = None   # the engine's destructor stops its threads and closes its sockets
        sweep_directory(self.directory)

    def health(self) -> dict:
        with self._lock:
            stats = {k: int(v) for k, v in self._stats.items()}
            pending = len(self._published)
        return {"backend": self.name, "ok": not self._closed, "peer": self.peer,
                "payloads_pending": pending, **self._pool.stats(), **stats}


def _valid_handle(handle) -> bool:
    return (isinstance(handle, dict) and isinstance(handle.get("peer"), str) and isinstance(handle.get("addr"), int)
            and isinstance(handle.get("size"), int) and isinstance(handle.get("gen"), int)
            and handle["size"] >= 0 and handle["addr"] > 0 and handle["gen"] > 0)


def _entry_target(handle: dict) -> str:
    return f"{handle['peer']}@{handle['addr']}@{handle['size']}@{handle['gen']}@{handle['pid']}"


def _read_entry(path: str) -> dict | None:
    """The handle a directory entry holds, or None (gone, or not one of ours)."""
    try:
        parts = os.readlink(path).split("@")
    except OSError:
        return None
    if len(parts) != 5:
        return None
    try:
        addr, size, gen, pid = (int(p) for p in parts[1:])
    except ValueError:
        return None
    handle = {"peer": parts[0], "addr": addr, "size": size, "gen": gen, "pid": pid}
    return handle if _valid_handle(handle) else None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_entry(path: str, handle: dict) -> None:
    """Unlink a directory entry if it still describes this handle's payload."""
    entry = _read_entry(path)
    if entry is not None and entry["peer"] == handle["peer"] and entry["gen"] == handle["gen"]:
        _unlink(path)
