"""Automatic prefix caching: KV blocks named by their content, kept after their request ends.

A full block's name is a chain hash: ``h_i = blake2b(h_{i-1} || token ids of block i)``, so equal
names mean equal tokens at equal positions *and* an equal prefix before them — exactly when the
block's keys and values are equal. The hashes are plain Python (no torch), deterministic across
processes and hosts (:mod:`omnirelay.workers.block_hash`, no torch), so a broker or gateway can
compute them for a prompt and compare them with the hashes a worker reports
(:meth:`PrefixCachingAllocator.drain_events`, :meth:`PrefixCachingAllocator.names`).

Life of a block in :class:`PrefixCachingAllocator`::

    free ──allocate──▶ in use (ref ≥ 1) ──register(hash) once its tokens are computed──▶ in use, named
    in use, named ──release, ref 0──▶ cached (named, evictable, least recently used first)
    cached ──acquire (a later prompt's prefix matched it)──▶ in use, named
    cached ──allocate found no free block: evicted, name dropped──▶ in use (new content)
    in use, unnamed ──release, ref 0──▶ free

A block is shared by every running request whose prefix matched it (reference counted) and is
never written while shared: a request only writes blocks past its matched prefix, and the match
stops before the prompt's last token so that token's logits are always computed.
"""

from __future__ import annotations

import collections

from omnirelay.workers.kv.cache import OutOfBlocks


class PrefixCachingAllocator:
    """Drop-in for :class:`~omnirelay.workers.kv.cache.BlockAllocator` (``free``, ``allocate``,
    ``release``) plus content naming. Block 0 is never handed out (the padding target)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))
        self._refs = [0] * num_blocks
        self._name_of: dict[int, bytes] = {}
        self._by_name: dict[bytes, int] = {}
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()   # LRU first
        self._events: dict[bytes, bool] = {}   # name → cached now? (net change since the last drain)

    @property
    def free(self) -> int:
        """Blocks an ``allocate`` can hand out now: never-named ones and evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._by_name)

    def match(self, hashes: list[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of ``hashes`` (references unchanged)."""
        blocks = []
        for name in hashes:
            block = self._by_name.get(name)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference on matched blocks (cached ones stop being evictable)."""
        for block in blocks:
            self._refs[block] += 1
            self._cached.pop(block, None)

    def allocate(self, n: int) -> list[int]:
        if n > self.free:
            raise OutOfBlocks(f"need {n} blocks, {self.free} free")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._cached.popitem(last=False)
                name = self._name_of.pop(block)
                del self._by_name[name]
                self._events[name] = False
            self._refs[block] = 1
            out.append(block)
        return out

    def register(self, block: int, name: bytes) -> None:
        """``block`` now holds the content ``name`` (its tokens' KV is computed). A second block
        with the same content (two identical prompts computed in one step) stays unnamed."""
        if block in self._name_of or name in self._by_name:
            return
        self._name_of[block] = name
        self._by_name[name] = block
        self._events[name] = True

    def release(self, blocks: list[int]) -> None:
        # Reversed: a request's tail blocks become the least recently used, so eviction takes a
        # prompt's unique suffix before the shared prefix that other prompts are likely to reuse.
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._name_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    def names(self) -> list[bytes]:
        """Every name cached now (a full snapshot, e.g. after the broker lost its copy)."""
        return list(self._by_name)

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """Names added and evicted since the last call (what a heartbeat would carry)."""
        events, self._events = self._events, {}
        return [n for n, on in events.items() if on], [n for n, on in events.items() if not on]
