"""Paged KV cache: one preallocated block pool per layer and a free-list allocator.

A sequence owns a list of block ids (its block table); token ``t`` of the sequence lives in block
``table[t // block_size]`` at offset ``t % block_size``. Sequences join and leave without moving
anyone else's blocks. The pool is sized once from a byte budget, so memory use is fixed at start-up.
"""

from __future__ import annotations

import torch


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for (the scheduler preempts or waits)."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        # Block 0 is kept back as the padding target of block tables, so padded gathers never
        # read a block that another sequence is writing in the same step.
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedKVCache:
    PAD_BLOCK = 0

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, block_size: int = 16,
                 num_blocks: int | None = None, budget_bytes: int | None = None,
                 dtype: torch.dtype = torch.float32):
        per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize
        if num_blocks is None:
            if budget_bytes is None:
                raise ValueError("give num_blocks or budget_bytes")
            num_blocks = budget_bytes // per_block
        if num_blocks < 2:
            raise ValueError(f"KV budget too small: {num_blocks} blocks of {per_block} bytes")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.bytes_per_block = per_block
        self.allocator = BlockAllocator(num_blocks)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zero-filled so first touch of the pool happens here, not in the first request's step.
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slots_for(self, block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(block_tables.shape[0])
        blocks = block_tables[rows, positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [N, kv_heads, head_dim] written at flat ``slots`` [N]."""
        self.keys[layer].view(-1, *k.shape[1:])[slots] = k
        self.values[layer].view(-1, *v.shape[1:])[slots] = v

    def write_sequence(self, blocks: list[int], kv: torch.Tensor) -> None:
        """Copy a contiguous ``[layers, 2, seq, kv_heads, head_dim]`` KV into ``blocks``."""
        seq = kv.shape[2]
        positions = torch.arange(seq)
        table = torch.tensor(blocks, dtype=torch.long)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        for layer in range(kv.shape[0]):
            self.write(layer, slots, kv[layer, 0], kv[layer, 1])

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, max_blocks] → keys, values [B, max_blocks * block_size, kv_heads, head_dim]."""
        b, n = block_tables.shape
        keys = self.keys[layer][block_tables].view(b, n * self.block_size, *self.keys[layer].shape[2:])
        values = self.values[layer][block_tables].view(b, n * self.block_size, *self.values[layer].shape[2:])
        return keys, values
