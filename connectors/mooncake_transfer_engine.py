"""``mooncake_transfer_engine`` connector: the consumer reads the payload out of the producer's
memory with Mooncake's transfer engine (RDMA where the hardware is, TCP here), peer to peer.

Each connector starts one ``mooncake.engine.TransferEngine`` in ``P2PHANDSHAKE`` mode (no metadata
server: peers address each other as ``ip:rpc_port``) and registers one :class:`BufferPool` with it,
once. That pool holds both the payloads this process produced and the ones it received.

The life of one payload::

    producer put:  encode into a pool block behind a 64-byte header → publish (header generation,
                   directory entry) → handle {"peer", "addr", "size", "gen"}
    (or in place:  reserve → the caller fills tensor views of a pool block → put_reserved writes
                   the header and the extra items around them → the same publish)
    consumer get:  read header + payload from (peer, addr) into its own pool block, timing the
                   read → check the header (magic, generation, not yet acknowledged) → read the
                   generation again (a seqlock: a block the producer recycled meanwhile is
                   detected), unless the producer quarantines freed blocks (``quarantine_ms``,
                   named in the handle as ``q``) and the read took less than half of that → decode
    consumer delete: write the generation into the header's ``acked`` word on the producer
    producer (next put): free acknowledged blocks and blocks older than ``ttl_s``: zero their
                   generation at once, return them to the pool (``quarantine_ms`` later)

Why one read is enough when it is quick: a torn read needs some payload byte read after the
block was recycled (time r), while the header bytes of the same read showed the valid,
unacknowledged generation, so were read before the producer zeroed it (time z). Recycling waits
out the quarantine, r ≥ z + Q, so that read lasted longer than Q. A read the reader timed at under
Q/2 (a factor 2 for clock-rate error and timer granularity) cannot be torn; a longer one pays the
second round trip. The reader takes Q from the handle, so it never trusts more than the producer
guarantees; a key-only get (the directory entry carries no Q) always reads twice.

Header layout (little-endian): ``magic u64 | gen u64 | size u64 | acked u64 | key hash 16 B``.
``gen`` is 0 while the block is being written (or filled in place), and from the moment it is freed.

Key-only retrieval uses a **directory** of entries, ``<directory>/omnirelay-<pid>-<key hash>``:
symlinks that are never followed, whose target text ``<peer>@<addr>@<size>@<gen>`` is the handle
(one ``symlink`` to publish, one ``readlink`` to look up); the key hash in the block header guards
against a colliding name. A directory on the local tmpfs serves one host; a shared directory, or
the handles the broker carries, serve several. Entries of dead producers are swept when a
connector starts and when it closes.

Per-transfer costs kept small: a put frees acknowledged blocks *before* it allocates; checking
the ``acked`` words costs one memory read per payload in flight, so with many in flight that check
runs once per ``n // 8`` puts (and whenever the pool runs out); a consumer's delete finds the
producer's entry from the handle (it names the producer's ``pid``) instead of scanning the
directory. Quarantined blocks wait in a FIFO and go back to the pool on the first allocation after
their time; a pool with nothing free falls back to a one-off region rather than recycle early.

The payload lives in the producer's memory: once the producer's connector is closed (or its
process dies), payloads nobody fetched are gone and a ``get`` fails with ``TransferFailed``.

Security: the engine's handshake and TCP transport listen on all interfaces (Mooncake chooses
that; ``local_hostname`` only sets the address peers are told), and any peer that reaches them may
read or write the registered pool by address, as with RDMA. Run it on a trusted network only, or
firewall its ports; payloads are not authenticated beyond the key-hash check in the header.

Options: ``local_hostname`` (default 127.0.0.1: the address peers use to reach this process),
``metadata_server`` (``P2PHANDSHAKE``), ``protocol`` (``tcp``; ``rdma`` with ``device_name``),
``device_name`` (""), ``pool_mb`` (256), ``ttl_s`` (300), ``directory``
(``/dev/shm/omnirelay-mooncake``), ``quarantine_ms`` (0: off; see :data:`DEFAULT_QUARANTINE_MS`).
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
from .base import DEFAULT_GET_TIMEOUT_S, DEFAULT_TTL_S, Connector, Handle, Layout, Lent, Payload, Reservation, check_layout
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

# The ``quarantine_ms`` option: how long a freed block waits before the pool hands it out again.
# What it buys: a get whose single read took under half of it skips the second header read (one
# more round trip: 55–300 µs over loopback TCP, more between hosts). What it costs: throughput × Q
# of pool memory parked, and a put no longer rewrites the block freed just before it while that is
# still in the cache. Off by default: on loopback the colder put cost more than the saved round
# trip (BENCHMARKS.md, "Connectors"); a link with a long round trip is where it pays.
DEFAULT_QUARANTINE_MS = 0.0

# Block room a reservation keeps after its tensors for the data of ``put_reserved``'s bytes items:
# small ones (token ids, a short blob) then go in place too, for one page per reservation; larger
# ones fall back to a copy.
EXTRA_DATA_ROOM = 4096


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
        self.quarantine_s = float(config.pop("quarantine_ms", DEFAULT_QUARANTINE_MS)) / 1000
        if not 0 <= self.quarantine_s <= 60:
            raise ValueError("mooncake_transfer_engine connector: quarantine_ms must be between 0 and 60000")
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
        self._quarantine: collections.deque[tuple[float, Block | Region]] = collections.deque()  # (ready at, block)
        self._reservations_open = 0
        self._closed = False

    # ------------------------------------------------------------------------------ memory

    def _allocate(self, size: int) -> Block | Region:
        block = self._pool.allocate(size)
        if block is not None:
            return block
        self._reclaim(time.monotonic(), force=True)   # blocks out of quarantine may free enough
        return self._memory.allocate(size)

    def _entry_path(self, key: str, pid: int | None = None) -> str:
        return os.path.join(self.directory, f"{PREFIX}{pid or self._pid}-{_key_hash(key).hex()}")

    def _check_open(self) -> None:
        if self._closed:
            raise TransferFailed("mooncake_transfer_engine connector is closed")

    # ------------------------------------------------------------------------------ producer

    def put(self, key: str, payload: Payload) -> Handle:
        self._check_open()
        encode_plan = codec.plan(payload)
        self._reclaim(time.monotonic())
        memory = self._allocate(HEADER.size + encode_plan.size)
        try:
            return self._publish(key, memory, encode_plan)
        except BaseException:
            memory.release()
            raise

    def reserve(self, layout: Layout) -> Reservation:
        """Tensors that are views of a pool block, laid out as ``put_reserved`` will publish them."""
        self._check_open()
        reserved = codec.reserve_layout(check_layout(layout))
        self._reclaim(time.monotonic())
        memory = self._allocate(HEADER.size + reserved.end + EXTRA_DATA_ROOM)
        try:
            view = memory.view(HEADER.size + reserved.end)
            # The block may hold an old header (a payload received into it): gen 0 keeps a stale
            # reader from taking it for a payload while the caller fills the tensors.
            view[:HEADER.size] = bytes(HEADER.size)
            tensors = codec.reserved_views(view[HEADER.size:], reserved)
        except BaseException:
            memory.release()
            raise
        with self._lock:
            self._reservations_open += 1
        return Reservation(tensors, memory=Lent(self, memory, reserved, room=memory.size - HEADER.size))

    def _put_lent(self, key: str, lent: Lent, encode_plan: codec.EncodePlan) -> tuple[Handle, bool]:
        self._check_open()
        return self._publish(key, lent.memory, encode_plan), True

    def _return_lent(self, lent: Lent, kept: bool) -> None:
        with self._lock:
            self._reservations_open -= 1
        if not kept:
            lent.memory.release()   # never published, so no reader has its generation: no quarantine

    def _count(self, event: str) -> None:
        with self._lock:
            self._stats[event] += 1

    def _publish(self, key: str, memory: Block | Region, encode_plan: codec.EncodePlan) -> Handle:
        """Complete the payload in ``memory`` (header, then ``encode_plan``'s writes), make it
        readable and publish it under ``key``. The caller releases ``memory`` if this raises."""
        size = encode_plan.size
        view = memory.view(HEADER.size + size)
        try:
            HEADER.pack_into(view, 0, MAGIC, 0, size, 0, _key_hash(key))
            codec.write_into(view[HEADER.size:], encode_plan)
            gen = next(self._gens)
            struct.pack_into("<Q", view, _GEN_AT, gen)   # readable from here on
        finally:
            view.release()
        handle = {"peer": self.peer, "addr": memory.address, "size": size, "gen": gen, "pid": self._pid}
        if self.quarantine_s:
            handle["q"] = self.quarantine_s   # the reader may trust a read quicker than q / 2
        entry = self._entry_path(key)
        with self._lock:
            _link_entry(entry, _entry_target(handle))
            previous = self._by_key.get(key)
            if previous is not None:
                self._free(self._published.pop(previous), unlink=False)
            self._published[gen] = _Published(key, gen, size, memory, entry, time.monotonic())
            self._by_key[key] = gen
            self._stats["puts"] += 1
            self._stats["bytes_put"] += size
        return handle

    def _free(self, item: _Published, *, unlink: bool) -> None:
        """Retire a published block (caller holds the lock). Zeroing ``gen`` first makes any
        reader that still has the handle fail its check instead of reading the next payload; the
        quarantine lets a quick reader trust its single read (module docstring)."""
        view = item.memory.view(HEADER.size)
        struct.pack_into("<Q", view, _GEN_AT, 0)
        view.release()
        if self.quarantine_s:
            self._quarantine.append((time.monotonic() + self.quarantine_s, item.memory))
        else:
            item.memory.release()
        if self._by_key.get(item.key) == item.gen:
            del self._by_key[item.key]
            if unlink:
                _remove_entry(item.entry, {"peer": self.peer, "gen": item.gen})

    def _end_quarantine(self, now: float) -> None:
        """Return the blocks whose quarantine is over to the pool (caller holds the lock)."""
        while self._quarantine and self._quarantine[0][0] <= now:
            self._quarantine.popleft()[1].release()

    def _reclaim(self, now: float, force: bool = False) -> None:
        """End due quarantines; retire payloads their consumer acknowledged, and those older than
        the TTL. With many payloads in flight, the scan runs only every ``n // 8`` calls unless
        ``force`` (amortised cost)."""
        with self._lock:
            self._end_quarantine(now)
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
        self._check_open()
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
        size = handle["size"]
        memory = self._allocate(HEADER.size + size)
        leased = False
        try:
            problem = self._copy_consistent(key, handle, memory)
            if problem:
                return problem
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

    def _copy_consistent(self, key: str, handle: dict, memory: Block | Region) -> str | None:
        """Copy header + payload into ``memory``: None when the copy is the whole payload the
        handle names, untorn; otherwise why not."""
        peer, addr, size, gen = handle["peer"], handle["addr"], handle["size"], handle["gen"]
        started = time.monotonic()
        if self._engine.transfer_sync_read(peer, memory.address, addr, HEADER.size + size) != 0:
            return f"read from {peer} failed (peer gone or payload recycled)"
        took = time.monotonic() - started
        view = memory.view(HEADER.size)
        magic, got_gen, got_size, acked, key_hash = HEADER.unpack_from(view, 0)
        view.release()
        if magic != MAGIC or got_gen != gen or got_size != size or acked == gen or key_hash != _key_hash(key):
            return "payload was deleted or replaced"
        quarantine = handle.get("q", 0.0)
        if isinstance(quarantine, float) and took < quarantine / 2:
            return None   # too quick to span the producer's quarantine: the block was not recycled meanwhile
        with self._lock:
            self._stats["reads_rechecked"] += 1
        # Seqlock: the generation must not have changed while we copied the payload.
        if self._engine.transfer_sync_read(peer, memory.address, addr, HEADER.size) != 0:
            return f"read from {peer} failed"
        view = memory.view(HEADER.size)
        still = struct.unpack_from("<Q", view, _GEN_AT)[0]
        view.release()
        return None if still == gen else "payload was recycled during the read"

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
            self._end_quarantine(float("inf"))   # no reader can reach the pool once it is unregistered below
        self._memory.close()
        self._engine = None   # the engine's destructor stops its threads and closes its sockets
        sweep_directory(self.directory)

    def health(self) -> dict:
        with self._lock:
            stats = {k: int(v) for k, v in self._stats.items()}
            pending = len(self._published)
            quarantined = len(self._quarantine)
            reservations = self._reservations_open
        return {"backend": self.name, "ok": not self._closed, "peer": self.peer, "payloads_pending": pending,
                "blocks_quarantined": quarantined, "reservations_open": reservations, **self._pool.stats(), **stats}


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


def _link_entry(entry: str, target: str) -> None:
    """Point the directory entry at ``target``, replacing an older one atomically (put again)."""
    try:
        os.symlink(target, entry)   # the usual case: the key is new
    except FileExistsError:
        tmp = f"{entry}.{threading.get_ident()}.tmp"
        _unlink(tmp)
        os.symlink(target, tmp)
        os.rename(tmp, entry)


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
