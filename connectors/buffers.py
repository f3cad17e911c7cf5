"""Reusable memory for the network backends: one region allocated once, handed out in blocks.

Why: on this class of host the first touch of fresh memory runs at 0.1–1 GB/s while a copy into
warm memory runs at ~10 GB/s, so a backend that receives into a fresh ``bytearray`` per transfer
spends most of its time in page faults. A :class:`BufferPool` reserves one anonymous mapping per
connector (pages are faulted in on first use and stay resident), and blocks of it are reused.

Two ways to hold a block:

* **explicit** — ``block = pool.allocate(n)`` … ``block.release()``: staging memory the caller
  frees itself (the encode buffer of a ``put``).
* **lease** — ``array = pool.lease(block)``: the block is returned to the pool when the last
  object that references ``array`` dies. ``get`` decodes tensors as zero-copy views into the
  leased array, so the memory is recycled exactly when the consumer drops the tensors and never
  before. Frees that the garbage collector triggers are queued and applied by the next
  ``allocate`` (a finalizer may run on any thread, at any allocation, so it never takes a lock).

The region's address (:attr:`BufferPool.address`) is stable, so a transfer engine can register it
once. Blocks are aligned to :data:`BLOCK_ALIGN` bytes.
"""

from __future__ import annotations

import bisect
import collections
import mmap
import threading
import weakref
from collections.abc import Callable

import numpy as np

BLOCK_ALIGN = 4096


def _round_up(n: int, align: int = BLOCK_ALIGN) -> int:
    return (n + align - 1) // align * align


class Block:
    """``size`` bytes at ``offset`` of a pool; ``address`` is the absolute address."""

    __slots__ = ("pool", "offset", "size", "_released")

    def __init__(self, pool: "BufferPool", offset: int, size: int):
        self.pool, self.offset, self.size, self._released = pool, offset, size, False

    @property
    def address(self) -> int:
        return self.pool.address + self.offset

    def view(self, nbytes: int | None = None) -> memoryview:
        """A writable memoryview of the first ``nbytes`` (default: all) of the block."""
        return memoryview(self.pool._mm)[self.offset: self.offset + (self.size if nbytes is None else nbytes)]

    def release(self) -> None:
        """Give the block back now (explicit mode). Idempotent."""
        if not self._released:
            self._released = True
            self.pool._free_now(self.offset, self.size)


class Region:
    """A one-off buffer for a payload that does not fit the pool (same interface as :class:`Block`).

    ``register``/``unregister`` (optional) make it visible to a transfer engine for the duration of
    the transfer; ``release`` unregisters it. The memory itself lives as long as ``array`` (or a
    view of it) does, so tensors decoded from it stay valid after ``release``.
    """

    def __init__(self, size: int, register: Callable[[int, int], int] | None = None,
                 unregister: Callable[[int], int] | None = None):
        self.size = max(size, 1)
        self.array = np.frombuffer(mmap.mmap(-1, self.size), dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        self._unregister = unregister
        if register is not None and register(self.address, self.size) != 0:
            raise MemoryError(f"cannot register a {self.size}-byte buffer with the transfer engine")

    def view(self, nbytes: int | None = None) -> memoryview:
        return memoryview(self.array)[: self.size if nbytes is None else nbytes]

    def release(self) -> None:
        """Unregister (idempotent); the memory stays valid for whoever still holds ``array``."""
        if self._unregister is not None:
            self._unregister(self.address)
            self._unregister = None


class BufferPool:
    """A first-fit allocator over one anonymous mapping of ``capacity`` bytes.

    Thread-safe. ``allocate`` returns ``None`` when no free range is large enough: the caller
    decides whether to fall back to a one-off buffer or to fail.
    """

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError("buffer pool capacity must be positive")
        self.capacity = _round_up(capacity)
        self._mm = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self._mm.madvise(mmap.MADV_HUGEPAGE)  # fewer, cheaper first-touch faults where THP allows
        except (AttributeError, OSError):
            pass
        self._array = np.frombuffer(self._mm, dtype=np.uint8)
        self.address = int(self._array.ctypes.data)
        self._lock = threading.Lock()
        self._starts: list[int] = [0]            # free ranges, sorted by start
        self._sizes: dict[int, int] = {0: self.capacity}
        self._pending: collections.deque[tuple[int, int]] = collections.deque()  # frees from finalizers
        self.in_use = 0

    # ----------------------------------------------------------------------------- allocation

    def allocate(self, nbytes: int) -> Block | None:
        size = _round_up(max(nbytes, 1))
        with self._lock:
            self._drain_pending()
            for i, start in enumerate(self._starts):
                free = self._sizes[start]
                if free >= size:
                    del self._sizes[start]
                    if free == size:
                        del self._starts[i]
                    else:
                        self._starts[i] = start + size
                        self._sizes[start + size] = free - size
                    self.in_use += size
                    return Block(self, start, size)
        return None

    def lease(self, block: Block, start: int = 0, nbytes: int | None = None) -> np.ndarray:
        """Hand the block over to the garbage collector: returns a writable ``uint8`` array over
        ``nbytes`` of it from ``start``; the block returns to the pool when that array is gone.

        Use the array itself as the buffer (``memoryview(array)``, ``codec.decode(array)``):
        a numpy *slice* of it refers to the pool's base array, not to it, and would not keep the
        block leased.
        """
        if block._released:
            raise ValueError("block already released")
        block._released = True
        begin = block.offset + start
        end = block.offset + (block.size if nbytes is None else start + nbytes)
        array = self._array[begin:end]
        weakref.finalize(array, self._pending.append, (block.offset, block.size))
        return array

    def _free_now(self, offset: int, size: int) -> None:
        with self._lock:
            self._insert(offset, size)

    def _drain_pending(self) -> None:
        while self._pending:
            self._insert(*self._pending.popleft())

    def _insert(self, offset: int, size: int) -> None:
        """Return a range to the free list, merging with its neighbours. Caller holds the lock."""
        self.in_use -= size
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and offset + size == self._starts[i]:   # merge with the next range
            nxt = self._starts.pop(i)
            size += self._sizes.pop(nxt)
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._sizes[prev] == offset:                       # merge with the previous one
                self._sizes[prev] += size
                return
        self._starts.insert(i, offset)
        self._sizes[offset] = size

    # ---------------------------------------------------------------------------------- state

    def stats(self) -> dict:
        """Counters for ``health()``; lock-free (may be a moment stale)."""
        return {"pool_bytes": self.capacity, "pool_in_use": self.in_use, "pool_pending_frees": len(self._pending)}
