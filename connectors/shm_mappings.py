"""The consumer side of ``shared_memory``: segments stay mapped between gets.

The life of one get through the cache (:meth:`MappingCache.lease`), after the connector has opened
the segment, taken its shared ``flock`` (the lease) and confirmed the key entry::

    cached mapping of this segment (same inode)? ──no──▶ map the whole segment once (MAP_PRIVATE)
        │ yes                                                   │
        ▼                                                       ▼
    a lease on it still alive? ──yes──▶ None: the caller maps this payload afresh
        │ no
        ▼
    any page of [0, size) a private copy (pagemap)? ──yes──▶ MADV_DONTNEED drops the copies
        │
        ▼
    a uint8 array over [0, size); its finalizer closes the lease descriptor

Why: a fresh mapping of a segment faults in every page on first read (~1 GB/s of minor faults
here), while a mapping whose page table is already populated reads at memory speed. The producer
reuses its segments (a pool), so a consumer that keeps them mapped reads later payloads without a
single fault or ``mmap`` call.

Why the pagemap check: the mapping is copy-on-write so that writes into got tensors stay private.
A page a previous reader wrote is an anonymous copy that would hide the producer's next payload;
the ``PAGEMAP_SCAN`` ioctl on ``/proc/self/pagemap`` finds such pages (present, not file-backed;
~60 ns per page scanned here, against ~450 ns per page of faulting a fresh mapping in), and
``MADV_DONTNEED`` on a private file mapping discards them. Where that ioctl is missing (Linux
before 6.7) the cache is off and every get maps afresh.

Frees that finalizers trigger (on any thread, at any allocation) only append to a deque; the next
``lease`` applies them under the connector's lock.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import fcntl
import mmap
import os
import struct
import time
import weakref

import numpy as np

PAGE = mmap.PAGESIZE
# PAGEMAP_SCAN (Linux 6.7+, <linux/fs.h>): struct pm_scan_arg is 12 u64s (size, flags, start, end,
# walk_end, vec, vec_len, max_pages, category_inverted, category_mask, category_anyof_mask,
# return_mask); it fills ``vec`` with struct page_region {start, end, categories} and returns
# how many regions matched. A page matches "present and not file-backed" with the FILE bit inverted.
_SCAN_ARG = struct.Struct("<12Q")
_PAGEMAP_SCAN = (3 << 30) | (_SCAN_ARG.size << 16) | (ord("f") << 8) | 16   # _IOWR('f', 16, struct pm_scan_arg)
_PAGE_IS_FILE, _PAGE_IS_PRESENT = 1 << 2, 1 << 3
PRUNE_INTERVAL_S = 1.0


@dataclasses.dataclass(eq=False)
class _Mapping:
    name: str
    path: str
    inode: int
    mapping: mmap.mmap
    address: int
    capacity: int
    leases: int = 0


def _end_lease(fd: int, released: collections.deque, entry: _Mapping) -> None:
    """Finalizer of a leased array: drop the flock (close its descriptor), count the lease off later."""
    os.close(fd)
    released.append(entry)


class MappingCache:
    """Mappings of other processes' segments, least recently used first. Not locked itself: the
    connector calls every method under its own lock."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._maps: collections.OrderedDict[str, _Mapping] = collections.OrderedDict()
        self._bytes = 0
        self._released: collections.deque[_Mapping] = collections.deque()
        self._pagemap = -1
        self._region = (ctypes.c_uint64 * 3)()   # PAGEMAP_SCAN's output: one page_region
        self._last_prune = time.monotonic()
        if capacity_bytes > 0:
            try:
                self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
                self._has_private_pages(ctypes.addressof(self._region) // PAGE * PAGE, PAGE)   # the ioctl exists
            except OSError:
                # Cannot prove a reused mapping clean (no pagemap, or a kernel before 6.7): map
                # every get afresh.
                if self._pagemap >= 0:
                    os.close(self._pagemap)
                    self._pagemap = -1
                self.capacity_bytes = 0

    def lease(self, name: str, path: str, fd: int, st: os.stat_result, size: int) -> np.ndarray | None:
        """A ``uint8`` array over the first ``size`` bytes of the segment open as ``fd`` (leased by
        the caller), or None when the caller should map it afresh. On success the array owns ``fd``."""
        if self.capacity_bytes <= 0 or st.st_size > self.capacity_bytes:
            return None
        self._drain()
        entry = self._maps.get(name)
        if entry is not None and (entry.inode != st.st_ino or entry.capacity < size):
            self._drop(entry)
            entry = None
        if entry is None:
            # From a descriptor of its own: mmap keeps a duplicate of the one it is given, and a
            # duplicate of the lease descriptor would hold the lease for as long as the cache does.
            own = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if os.fstat(own).st_ino != st.st_ino:
                    return None
                mapping = mmap.mmap(own, st.st_size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(own)
            probe = np.frombuffer(mapping, dtype=np.uint8, count=1)
            entry = _Mapping(name, path, st.st_ino, mapping, int(probe.ctypes.data), st.st_size)
            del probe
            self._maps[name] = entry
            self._bytes += entry.capacity
            self._evict()
        elif entry.leases:
            return None   # its holder may be writing into it
        else:
            self._maps.move_to_end(name)
            if self._has_private_pages(entry.address, size):
                entry.mapping.madvise(mmap.MADV_DONTNEED, 0, size)
        array = np.frombuffer(entry.mapping, dtype=np.uint8, count=size)
        entry.leases += 1
        weakref.finalize(array, _end_lease, fd, self._released, entry)
        return array

    def _has_private_pages(self, address: int, size: int) -> bool:
        """Whether a page of ``[address, address + size)`` is present but not file-backed (a
        private copy): one ``PAGEMAP_SCAN`` ioctl that stops at the first such page."""
        arg = _SCAN_ARG.pack(_SCAN_ARG.size, 0, address, address + size, 0, ctypes.addressof(self._region), 1, 1,
                             _PAGE_IS_FILE, _PAGE_IS_FILE | _PAGE_IS_PRESENT, 0, _PAGE_IS_FILE | _PAGE_IS_PRESENT)
        return fcntl.ioctl(self._pagemap, _PAGEMAP_SCAN, bytearray(arg), True) > 0

    def _drain(self) -> None:
        while self._released:
            self._released.popleft().leases -= 1

    def _evict(self) -> None:
        for entry in list(self._maps.values()):
            if self._bytes <= self.capacity_bytes:
                break
            if not entry.leases:
                self._drop(entry)

    def _drop(self, entry: _Mapping) -> None:
        if self._maps.get(entry.name) is entry:
            del self._maps[entry.name]
            self._bytes -= entry.capacity
        try:
            entry.mapping.close()
        except BufferError:   # leased arrays still view it: unmapped when the last one dies
            pass

    def forget(self, name: str) -> None:
        """Unmap a segment now (its last consumer unlinked it)."""
        entry = self._maps.get(name)
        if entry is not None:
            self._drop(entry)

    def prune(self, force: bool = False) -> None:
        """Unmap segments that were unlinked or replaced, so their memory is freed; at most once per
        :data:`PRUNE_INTERVAL_S` unless ``force``."""
        now = time.monotonic()
        if not self._maps or (not force and now - self._last_prune < PRUNE_INTERVAL_S):
            return
        self._last_prune = now
        for entry in list(self._maps.values()):
            try:
                alive = os.stat(entry.path).st_ino == entry.inode
            except OSError:
                alive = False
            if not alive:
                self._drop(entry)

    def close(self) -> None:
        self._drain()
        for entry in list(self._maps.values()):
            self._drop(entry)
        if self._pagemap >= 0:
            os.close(self._pagemap)
            self._pagemap = -1
        self.capacity_bytes = 0

    def stats(self) -> dict:
        return {"mappings_cached": len(self._maps), "mapping_bytes": self._bytes}
