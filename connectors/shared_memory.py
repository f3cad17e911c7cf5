"""``shared_memory`` connector: POSIX shared memory under /dev/shm, one host, reused segments.

Files (every name starts ``omnirelay-<owner pid>-`` so :func:`sweep_orphans` can reclaim what a
crashed owner left behind):

``omnirelay-<pid>-c<conn>-s<n>`` — a **segment**: a tmpfs file that holds one encoded payload from offset
    0. The producer keeps it mapped and reuses it for later payloads (a pool), because writing
    into pages that are already resident runs ~10x faster here than faulting in fresh ones.
``omnirelay-<pid>-<key hash>`` — a **key entry**: a symlink that is never followed; its target
    text ``<segment>@<generation>@<size>`` says where the key's current payload lives. Key-only
    retrieval is a directory lookup of ``*-<key hash>``.

The life of a segment (a small state machine, :class:`SegmentState`, kept by the producer):

    FREE ──put: flock EX (no lease left)──▶ WRITING ──write, unlock, publish entry──▶ PUBLISHED
      ▲                                                                                │
      └─── its entry is gone (consumer delete), superseded (put again), expired (TTL) ◀┘

A consumer ``get`` opens the segment, takes a shared ``flock`` (its **lease**) and re-reads the key
entry to confirm the segment still holds that generation. The lease descriptor lives exactly as
long as any tensor decoded from the payload (a finalizer on the buffer they view closes it): a
producer never overwrites memory a consumer still reads, tensors stay valid after ``delete``, and a
consumer that dies drops its leases with its descriptors. Writes into got tensors stay private to
the consumer (MAP_PRIVATE).

The consumer keeps each segment it has read **mapped** (a cache of ``pool_mb`` bytes, least
recently used out), so a later get from the same pooled segment maps nothing and faults in no
page: its page table still points at the producer's pages, and reading a payload runs at memory
speed instead of ~1 GB/s of minor faults. Reuse must not leak a previous reader's private writes:
before a cached mapping is handed out again, one ``PAGEMAP_SCAN`` ioctl tells whether any page of
the range became a private (anonymous) copy, and if one did, ``MADV_DONTNEED`` drops the copies so
the range reads the segment again (:mod:`omnirelay.connectors.shm_mappings`). A mapping that still has a live lease is not reused (that get maps
the segment afresh). A cached mapping keeps the memory of a segment its producer unlinked until
this connector's next get, delete or close notices (at most once a second) and unmaps it.

``reserve`` takes a segment exactly as a put does (state WRITING, exclusively locked) and lends its
payload area as tensors; ``put_reserved`` writes only the header (and any added items) and publishes
it, so the tensors' bytes are written once, by the producer, where the consumer maps them.

``delete`` unlinks the key entry; the producer notices and recycles the segment. While a producer
connector is open it holds an exclusive ``flock`` on its **owner file** ``omnirelay-<pid>-c<n>-owner``;
a ``delete`` whose segment has no live owner (the connector was closed, or the process died) unlinks
the segment as well, so a payload that outlived its producer's connector is gone once consumed.

A new connector sweeps the segments of dead owners from its directory (``omni-serve`` also sweeps
when it starts and stops).

Options: ``ttl_s`` (default 300): a payload nobody deleted is unpublished after this long;
``shm_dir`` (default /dev/shm); ``pool_mb`` (default 512): bytes of free segments kept for reuse,
and bytes of other producers' segments a consumer keeps mapped; 0 disables both.

Per-transfer work is kept constant in the number of payloads in flight: the producer keeps its
free and published segments in separate collections (TTL expiry looks at the oldest only), and
checks whether consumers deleted published entries (a ``readlink`` each) at most once per
``n // 8`` puts when ``n`` are in flight; a consumer's ``delete`` renames the entry it got instead
of scanning the directory.

We use ``os.open`` + ``mmap`` rather than ``multiprocessing.shared_memory``, whose resource
tracker unlinks (or warns about) segments another process still needs.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import fcntl
import glob
import hashlib
import itertools
import mmap
import os
import threading
import time

from omnirelay.errors import TransferFailed

from . import codec
from .base import DEFAULT_GET_TIMEOUT_S, DEFAULT_TTL_S, Connector, Handle, Layout, Lent, Payload, Reservation, check_layout
from .shm_mappings import MappingCache

PREFIX = "omnirelay-"
SHM_DIR = "/dev/shm"
MIN_SEGMENT = 64 * 1024
_instances = itertools.count()   # tells apart the connectors of one process in segment names


def _key_hash(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=12).hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(name: str) -> int | None:
    """The owner PID encoded in a file name, or None if the name is not one of ours."""
    if not name.startswith(PREFIX):
        return None
    head = name[len(PREFIX):].split("-", 1)[0]
    if not head.isdigit() or len(head) > 10:   # a PID fits in 10 digits; anything longer is not ours
        return None
    return int(head)


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def sweep_orphans(shm_dir: str = SHM_DIR, owners: set[int] | None = None) -> int:
    """Unlink segments and key entries whose owner process is dead (or, with ``owners``, that
    belong to those PIDs). Returns how many files were removed. Safe at any time from any process:
    a consumer that still maps a removed segment keeps its data."""
    removed = 0
    for path in glob.glob(os.path.join(glob.escape(shm_dir), PREFIX + "*")):
        pid = _owner(os.path.basename(path))
        if pid is None:
            continue
        if (owners is not None and pid in owners) or (owners is None and not _pid_alive(pid)):
            removed += _unlink(path)
    return removed


class SegmentState(enum.Enum):
    FREE = "free"            # reusable once no consumer lease remains
    WRITING = "writing"      # a put is filling it
    PUBLISHED = "published"  # a key entry points to it


@dataclasses.dataclass(eq=False)
class _Segment:
    name: str
    path: str
    fd: int
    mapping: mmap.mmap
    capacity: int
    allocated: int = 0                    # bytes reserved with fallocate (never shrinks)
    state: SegmentState = SegmentState.FREE
    entry: str = ""                       # the key entry that publishes it
    target: str = ""                      # that entry's expected symlink target
    published_at: float = 0.0
    freed_at: float = 0.0


def _parse_target(target: str) -> tuple[str, int, int] | None:
    """``(segment name, generation, size)`` from a key entry's target text."""
    parts = target.split("@")
    if len(parts) != 3 or _owner(parts[0]) is None or "/" in parts[0]:
        return None
    try:
        return parts[0], int(parts[1]), int(parts[2])
    except ValueError:
        return None


def _owner_file(segment_name: str) -> str:
    return segment_name.rsplit("-", 1)[0] + "-owner"


def _owner_gone(shm_dir: str, segment_name: str) -> bool:
    """True when no open connector owns the segment (its owner file is missing or unlocked)."""
    try:
        fd = os.open(os.path.join(shm_dir, _owner_file(segment_name)), os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


class SharedMemoryConnector(Connector):
    name = "shared_memory"
    local_writes = True   # tmpfs writes under non-blocking locks: no wait on anyone

    def __init__(self, config: dict | None = None):
        config = dict(config or {})
        self.shm_dir = str(config.pop("shm_dir", SHM_DIR))
        self.ttl_s = float(config.pop("ttl_s", DEFAULT_TTL_S))
        self.pool_bytes = int(float(config.pop("pool_mb", 512)) * (1 << 20))
        if config:
            raise ValueError(f"shared_memory connector: unknown options {sorted(config)}")
        if not os.path.isdir(self.shm_dir):
            raise ValueError(f"shared_memory connector: {self.shm_dir} is not a directory")
        sweep_orphans(self.shm_dir)   # what crashed processes left behind
        self._pid = os.getpid()
        self._stem = f"{PREFIX}{self._pid}-c{next(_instances)}"
        self._owner_fd = -1                            # the owner file, created by the first put
        self._lock = threading.Lock()
        self._segments: list[_Segment] = []           # every segment this producer holds open
        self._free: list[_Segment] = []                # those in state FREE
        self._published: dict[_Segment, None] = {}     # those in state PUBLISHED, oldest first
        self._by_entry: dict[str, _Segment] = {}       # entry path → the segment it publishes
        self._puts_since_scan = 0
        self._ids = itertools.count()
        self._gens = itertools.count(1)
        self._maps = MappingCache(self.pool_bytes)     # consumer side: segments kept mapped
        self._got: collections.OrderedDict[str, str] = collections.OrderedDict()  # key → entry got
        self._closed = False
        self._stats = collections.Counter()

    # ------------------------------------------------------------------------------- naming

    def _entry_path(self, key: str, pid: int | None = None) -> str:
        return os.path.join(self.shm_dir, f"{PREFIX}{pid or self._pid}-{_key_hash(key)}")

    def _entries(self, key: str) -> list[str]:
        """Every producer's entry for ``key`` (a directory scan: no pattern compiled per key)."""
        suffix = f"-{_key_hash(key)}"
        try:
            with os.scandir(self.shm_dir) as it:
                return [e.path for e in it if e.name.endswith(suffix) and _owner(e.name) is not None]
        except OSError:
            return []

    # ------------------------------------------------------------------------------ producer

    def put(self, key: str, payload: Payload) -> Handle:
        if self._closed:
            raise TransferFailed("shared_memory connector is closed")
        encode_plan = codec.plan(payload)
        segment = self._acquire(encode_plan.size)
        self._write(segment, encode_plan)
        return self._publish(key, segment, encode_plan.size)

    def reserve(self, layout: Layout) -> Reservation:
        """The tensors are views of a segment locked for writing, as a put's would be; it is
        published by :meth:`put_reserved` without a copy, or freed by :meth:`release`."""
        if self._closed:
            raise TransferFailed("shared_memory connector is closed")
        reserved = codec.reserve_layout(check_layout(layout))
        segment = self._acquire(reserved.end)
        try:
            self._allocate_pages(segment, reserved.end)
            tensors = codec.reserved_views(memoryview(segment.mapping), reserved)
        except BaseException as exc:
            self._discard(segment)
            if isinstance(exc, OSError):
                raise TransferFailed(f"shared_memory: cannot reserve {reserved.end} bytes in {self.shm_dir}: "
                                     f"{exc}") from exc
            raise
        self._count("reservations")
        return Reservation(tensors, memory=Lent(self, segment, reserved, room=segment.capacity))

    def _put_lent(self, key: str, lent: Lent, encode_plan: codec.EncodePlan) -> tuple[Handle, bool]:
        if self._closed:
            raise TransferFailed("shared_memory connector is closed")
        self._write(lent.memory, encode_plan)
        return self._publish(key, lent.memory, encode_plan.size), True

    def _return_lent(self, lent: Lent, kept: bool) -> None:
        segment = lent.memory
        with self._lock:
            if kept or self._closed or segment not in self._segments or segment.state is not SegmentState.WRITING:
                return   # published, discarded by a failed write, or closed with the connector
            fcntl.flock(segment.fd, fcntl.LOCK_UN)
            self._set_free(segment)

    def _count(self, event: str) -> None:
        with self._lock:
            self._stats[event] += 1

    def _allocate_pages(self, segment: _Segment, size: int) -> None:
        if segment.allocated < size:
            # Reserve the pages now: on a full /dev/shm this raises ENOSPC here instead of
            # killing the process with SIGBUS while we write.
            os.posix_fallocate(segment.fd, segment.allocated, size - segment.allocated)
            segment.allocated = size

    def _write(self, segment: _Segment, encode_plan: codec.EncodePlan) -> None:
        """Write an encoded payload (or what a reservation lacks) into a segment locked for
        writing, then unlock it; a failure discards the segment."""
        size = encode_plan.size
        try:
            self._allocate_pages(segment, size)
            view = memoryview(segment.mapping)[:size]
            try:
                codec.write_into(view, encode_plan)
            finally:
                view.release()
            fcntl.flock(segment.fd, fcntl.LOCK_UN)
        except BaseException as exc:
            self._discard(segment)
            if isinstance(exc, OSError):
                raise TransferFailed(f"shared_memory: cannot write {size} bytes to {self.shm_dir}: {exc}") from exc
            raise

    def _publish(self, key: str, segment: _Segment, size: int) -> Handle:
        """Point the key's entry at a written, unlocked segment; the payload is readable from here."""
        gen = next(self._gens)
        entry = self._entry_path(key)
        target = f"{segment.name}@{gen}@{size}"
        with self._lock:
            try:
                os.symlink(target, entry)   # the usual case: the key is new
            except FileExistsError:         # put again: replace the entry atomically
                tmp = f"{entry}.{threading.get_ident()}.tmp"
                _unlink(tmp)                # left by a put that failed half-way
                os.symlink(target, tmp)
                os.rename(tmp, entry)
            previous = self._by_entry.get(entry)
            if previous is not None and previous is not segment:
                self._set_free(previous)
            self._by_entry[entry] = segment
            segment.state, segment.entry, segment.target = SegmentState.PUBLISHED, entry, target
            segment.published_at = time.monotonic()
            self._published[segment] = None
            self._stats["puts"] += 1
            self._stats["bytes_put"] += size
        return {"segment": segment.name, "gen": gen, "size": size}

    def _acquire(self, size: int) -> _Segment:
        """A segment of at least ``size`` bytes, exclusively locked (no consumer maps it)."""
        with self._lock:
            self._reap_expired(time.monotonic())
            self._puts_since_scan += 1
            if self.pool_bytes > 0:
                segment = self._lock_free_segment(size) if self._free else None
                if segment is None and self._reclaim_consumed():
                    segment = self._lock_free_segment(size)
                if segment is not None:
                    segment.state = SegmentState.WRITING
                    self._free.remove(segment)
                    return segment
            else:
                self._reclaim_consumed()   # no reuse: consumed segments are unlinked just below
            self._evict(keep_bytes=max(self.pool_bytes - size, 0))
            self._ensure_owner_file()
            name = f"{self._stem}-s{next(self._ids)}"
        capacity = max(MIN_SEGMENT, 1 << (size - 1).bit_length())
        path = os.path.join(self.shm_dir, name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise TransferFailed(f"shared_memory: cannot create a segment in {self.shm_dir}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, capacity)   # sparse: only the bytes we write take memory
            mapping = mmap.mmap(fd, capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        segment = _Segment(name=name, path=path, fd=fd, mapping=mapping, capacity=capacity,
                           state=SegmentState.WRITING)
        with self._lock:
            self._segments.append(segment)
        return segment

    def _lock_free_segment(self, size: int) -> _Segment | None:
        """Best fit among free segments that no consumer still leases, the most recently freed
        first: its pages are the likeliest to be in the cache still. Caller holds the lock."""
        for segment in sorted((s for s in self._free if s.capacity >= size), key=lambda s: (s.capacity, -s.freed_at)):
            try:
                fcntl.flock(segment.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue   # a consumer still holds tensors that map it
            return segment
        return None

    def _reclaim_consumed(self) -> bool:
        """Free published segments whose key entry a consumer deleted. Caller holds the lock.

        Costs one ``readlink`` per published segment, so with many payloads awaiting their
        consumers it runs only once per ``len(published) // 8`` puts (amortised: at most ~8
        syscalls per put); in between, a put that finds no free segment creates one."""
        if len(self._published) > 8 and self._puts_since_scan * 8 < len(self._published):
            return False
        self._puts_since_scan = 0
        found = False
        for segment in list(self._published):
            if not self._entry_points_here(segment):
                self._by_entry.pop(segment.entry, None)
                self._set_free(segment)
                found = True
        return found

    @staticmethod
    def _entry_points_here(segment: _Segment) -> bool:
        try:
            return os.readlink(segment.entry) == segment.target
        except OSError:
            return False

    def _set_free(self, segment: _Segment) -> None:
        self._published.pop(segment, None)
        if segment.state is not SegmentState.FREE:
            self._free.append(segment)
        segment.state, segment.entry, segment.target = SegmentState.FREE, "", ""
        segment.freed_at = time.monotonic()

    def _ensure_owner_file(self) -> None:
        """Create and lock the owner file (caller holds the lock)."""
        if self._owner_fd >= 0:
            return
        path = os.path.join(self.shm_dir, f"{self._stem}-owner")
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._owner_fd = fd

    def _evict(self, keep_bytes: int) -> None:
        """Unlink least recently freed segments until free ones hold at most ``keep_bytes``."""
        free = sorted(self._free, key=lambda s: s.freed_at)
        total = sum(s.allocated for s in free)
        for segment in free:
            if total <= keep_bytes:
                break
            total -= segment.allocated
            self._forget(segment, unlink=True)
            self._stats["evicted"] += 1

    def _forget(self, segment: _Segment, *, unlink: bool) -> None:
        """Stop holding a segment (caller holds the lock, or the segment is not yet shared)."""
        if segment in self._segments:
            self._segments.remove(segment)
        if segment in self._free:
            self._free.remove(segment)
        self._published.pop(segment, None)
        if self._by_entry.get(segment.entry) is segment:
            del self._by_entry[segment.entry]
        if unlink:
            _unlink(segment.path)
        try:
            segment.mapping.close()
        except BufferError:   # a put in another thread is still writing: the GC unmaps it later
            pass
        os.close(segment.fd)

    def _discard(self, segment: _Segment) -> None:
        with self._lock:
            self._forget(segment, unlink=True)

    def _reap_expired(self, now: float) -> None:
        """Unpublish payloads older than the TTL: the oldest come first, so this stops at the
        first young one."""
        for segment in list(self._published):
            if now - segment.published_at < self.ttl_s:
                break
            if self._entry_points_here(segment):
                _unlink(segment.entry)
                self._stats["expired"] += 1
            self._by_entry.pop(segment.entry, None)
            self._set_free(segment)

    # ------------------------------------------------------------------------------ consumer

    def _resolve(self, key: str, handle: Handle | None) -> tuple[str, str, str] | None:
        """(entry path, expected target, segment name) for the key's current payload, or None."""
        if handle and isinstance(handle.get("segment"), str) and isinstance(handle.get("gen"), int):
            name = handle["segment"]
            pid = _owner(name)
            if pid is not None and "/" not in name and isinstance(handle.get("size"), int):
                # What the key entry says while the handle is current (checked under the lease).
                return self._entry_path(key, pid), f"{name}@{handle['gen']}@{handle['size']}", name
        for entry in self._entries(key):
            try:
                target = os.readlink(entry)
            except OSError:
                continue
            parsed = _parse_target(target)
            if parsed and _owner(parsed[0]) == _owner(os.path.basename(entry)):
                return entry, target, parsed[0]
        return None

    def _try_map(self, key: str, handle: Handle | None):
        """(the payload's bytes, its size, its entry), leased; or None if not (yet) readable."""
        located = self._resolve(key, handle)
        if located is None:
            return None
        entry, target, name = located
        size = _parse_target(target)[2]
        path = os.path.join(self.shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)   # the lease
            except BlockingIOError:
                return None   # the producer is rewriting it: the entry we read is stale
            try:
                if os.readlink(entry) != target:
                    return None   # superseded or deleted while we opened it
            except OSError:
                return None
            st = os.fstat(fd)
            if size <= 0 or st.st_size < size:
                raise TransferFailed(f"shared_memory: segment for key {key!r} is truncated")
            with self._lock:
                array = self._maps.lease(name, path, fd, st, size)
            if array is not None:
                fd = -1   # the array's finalizer closes it
                return array, size, entry
            # Not cached: a mapping of its own, which dups the descriptor, so the lease lives
            # exactly as long as the mapping.
            return mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE), size, entry
        finally:
            if fd >= 0:
                os.close(fd)

    def get(self, key: str, handle: Handle | None = None, timeout: float = DEFAULT_GET_TIMEOUT_S) -> Payload:
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            mapped = self._try_map(key, handle)
            if mapped is not None:
                buffer, size, entry = mapped
                try:
                    payload = codec.decode(buffer)
                except codec.CodecError as exc:
                    raise TransferFailed(f"shared_memory: segment for key {key!r} is corrupt: {exc}") from None
                with self._lock:
                    self._stats["gets"] += 1
                    self._stats["bytes_got"] += size
                    self._got[key] = entry
                    while len(self._got) > 4096:
                        self._got.popitem(last=False)
                    self._maps.prune()
                return payload
            if time.monotonic() >= deadline:
                raise TransferFailed(f"shared_memory: key {key!r} not available within {timeout:.1f}s")
            handle = None   # stale (the key was put again, or not yet published): look the key up
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def delete(self, key: str) -> None:
        with self._lock:
            got = self._got.pop(key, None)
        # The entry this connector got is the usual one; otherwise look for every producer's.
        for entry in ([got] if got is not None and os.path.lexists(got) else self._entries(key)):
            # Take the entry away under a private name first, so the target we read is the one we
            # removed even if its producer re-publishes the key at the same moment.
            grabbed = f"{entry}.{threading.get_ident()}.del"
            try:
                os.rename(entry, grabbed)
                target = os.readlink(grabbed)
            except OSError:
                continue
            _unlink(grabbed)
            parsed = _parse_target(target)
            gone = parsed is not None and _owner_gone(self.shm_dir, parsed[0])
            if gone:   # nobody left to recycle it
                _unlink(os.path.join(self.shm_dir, parsed[0]))
            with self._lock:
                if gone:
                    self._maps.forget(parsed[0])
                self._stats["deletes"] += 1
                segment = self._by_entry.get(entry)
                if segment is not None and segment.target == target:
                    del self._by_entry[entry]
                    self._set_free(segment)
        with self._lock:
            self._maps.prune()

    # ----------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Unlink free segments and expired payloads; payloads still awaiting their consumer stay
        (the consumer's delete removes them, since their owner is gone; or the sweep of dead
        owners). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._maps.close()
            self._reap_expired(time.monotonic())
            self._puts_since_scan = len(self._published)   # a full scan, whatever the count
            self._reclaim_consumed()
            if self._owner_fd >= 0:
                _unlink(os.path.join(self.shm_dir, f"{self._stem}-owner"))
                os.close(self._owner_fd)   # from now on a consumer's delete unlinks the segment
                self._owner_fd = -1
            for segment in list(self._segments):
                published = segment.state is SegmentState.PUBLISHED
                self._forget(segment, unlink=not published)
                if published and not os.path.lexists(segment.entry):   # consumed meanwhile
                    _unlink(segment.path)

    def health(self) -> dict:
        with self._lock:
            return {"backend": self.name, "ok": not self._closed,
                    "segments_pending": len(self._published), "segments_free": len(self._free),
                    "segment_bytes": sum(s.allocated for s in self._segments),
                    **self._maps.stats(), **{k: int(v) for k, v in self._stats.items()}}


__all__ = ["PREFIX", "SHM_DIR", "SegmentState", "SharedMemoryConnector", "sweep_orphans"]
