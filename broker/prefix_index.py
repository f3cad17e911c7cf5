"""Prefix-aware routing: which worker already holds the KV of a prompt's longest prefix.

Life of a prefix hint::

    gateway: prompt ids ──prompt_route_keys (block chain hashes, first 8 bytes as an int)──▶ Submit.prefix_hashes
    prefill worker: Register.block_size; every Heartbeat: keys of the blocks it cached / evicted since
        the last one (``prefix_added`` / ``prefix_evicted``), or its whole set (``prefix_full``)
    broker: one bounded :class:`PrefixSet` per worker ──pick_worker──▶ Task to the worker with the
        longest cached prefix among those with credit and not much busier than the least-loaded
        ──▶ the prompt's keys are added to that worker's set at once (it will hold them after prefill)

A block's name (:mod:`omnirelay.block_hash`) is a chain hash, so equal names mean an equal
prompt up to the end of that block; the broker compares the first 8 bytes as an unsigned integer
(msgpack carries it natively; a collision only costs a route that is not the best, since the worker
matches its cache with the full 16 bytes). Plain Python and no torch: the gateway imports it too.

Memory is bounded: a :class:`PrefixSet` keeps at most ``capacity`` keys, least recently touched
dropped first; a heartbeat's lists are truncated to the same bound. Hints are only that: a stale
set (a heartbeat not yet in) costs a cache miss, never a wrong answer.
"""

from __future__ import annotations

import collections
from typing import Iterable, Protocol

from omnirelay.block_hash import block_hashes

ROUTE_KEY_BYTES = 8
MAX_PROMPT_BLOCKS = 256   # a Submit carries keys for at most this many leading blocks (4096 tokens at 16)


def route_keys(names: Iterable[bytes]) -> list[int]:
    """The wire form of block names: the first 8 bytes of each, as an unsigned little-endian int."""
    return [int.from_bytes(name[:ROUTE_KEY_BYTES], "little") for name in names]


def prompt_route_keys(token_ids: list[int], block_size: int, max_blocks: int = MAX_PROMPT_BLOCKS,
                      lora: str = "", salt: str = "") -> list[int]:
    """Keys of the prompt blocks a prefill worker could reuse: full blocks only, and never the block
    holding the last prompt token (the worker always computes that token's logits). ``lora``: the
    adapter the prompt runs under (its blocks are named apart, as the worker names them); ``salt``:
    the request's ``cache_salt``, likewise."""
    if block_size <= 0:
        return []
    usable = min(max_blocks, (len(token_ids) - 1) // block_size)
    if usable <= 0:
        return []
    return route_keys(block_hashes(token_ids[:usable * block_size], block_size, lora, salt))


class PrefixSet:
    """The block keys one worker reported (or was just sent), at most ``capacity`` of them."""

    __slots__ = ("capacity", "_keys")

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._keys: collections.OrderedDict[int, None] = collections.OrderedDict()   # oldest first

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def add(self, keys: Iterable[int]) -> None:
        store = self._keys
        for key in keys:
            store[key] = None
            store.move_to_end(key)
        while len(store) > self.capacity:
            store.popitem(last=False)

    def discard(self, keys: Iterable[int]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def replace(self, keys: list[int]) -> None:
        self._keys.clear()
        self.add(keys[-self.capacity:])

    def hit_blocks(self, keys: list[int]) -> int:
        """Length of the longest prefix of ``keys`` held here (the worker's own match stops at its
        first miss too)."""
        store = self._keys
        n = 0
        for key in keys:
            if key not in store:
                break
            n += 1
        return n


class Candidate(Protocol):
    """What :func:`pick_worker` reads of a worker (the broker's ``WorkerState``)."""

    credits: int
    dispatched: int
    block_size: int
    prefix: PrefixSet | None
    tasks: set


def pick_worker(candidates: list[Candidate], keys: list[int], block_size: int, slack: int):
    """``(worker, hit_blocks)``: among ``candidates`` (all with credit), the one holding the longest
    prefix of ``keys`` (hashed at ``block_size``), provided it has at most ``slack`` more assigned
    tasks than the least-loaded candidate — so a popular prefix does not pile every request onto one
    worker. Ties, and requests without a usable hint, go in least-loaded order (:func:`_load`)."""
    least = min(candidates, key=_load)
    if not keys or block_size <= 0:
        return least, 0
    bound = len(least.tasks) + slack
    best, best_hits = least, -1
    for worker in candidates:
        if worker.prefix is None or worker.block_size != block_size or len(worker.tasks) > bound:
            continue
        hits = worker.prefix.hit_blocks(keys)
        if hits > best_hits or (hits == best_hits and _load(worker) < _load(best)):
            best, best_hits = worker, hits
    if best_hits <= 0:
        return least, 0
    return best, best_hits


def _load(worker) -> tuple[int, int, int]:
    """Least-loaded order: fewest assigned tasks, then most credit left, then fewest dispatched so
    far (idle workers take turns, so a new prefix lands on a worker other prefixes have not claimed)."""
    return len(worker.tasks), -worker.credits, worker.dispatched
