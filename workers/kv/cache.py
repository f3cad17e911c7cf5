"""Paged KV cache: one preallocated block pool per layer and a free-list allocator.

A sequence owns a list of block ids (its block table); token ``t`` of the sequence lives in block
``table[t // block_size]`` at offset ``t % block_size``. Sequences join and leave without moving
anyone else's blocks. The pool is sized once from a byte budget, so memory use is fixed at start-up.

The pool lives on one device (``device``: the rank's CPU or ``cuda:<id>``). Slots and block tables
of a step come on that device (the runner moved the batch); a sequence's KV written from elsewhere
(a connector's host tensor) is copied there once. :meth:`PagedKVCache.read_sequence` returns the
sequence on the pool's device: the runner decides when it crosses to the host.
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
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        per_block = self.block_bytes(num_layers, num_kv_heads, head_dim, block_size, dtype)
        if num_blocks is None:
            if budget_bytes is None:
                raise ValueError("give num_blocks or budget_bytes")
            num_blocks = budget_bytes // per_block
        if num_blocks < 2:
            raise ValueError(f"KV budget too small: {num_blocks} blocks of {per_block} bytes")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.bytes_per_block = per_block
        self.device = torch.device(device)
        self.allocator = BlockAllocator(num_blocks)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zero-filled so first touch of the pool happens here, not in the first request's step.
        self.keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @staticmethod
    def block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block over all layers, keys and values."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [N, kv_heads, head_dim] written at flat ``slots`` [N]."""
        # index_copy_ on a flat view: a plain scatter, several times cheaper than index_put.
        self.keys[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.values[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def _slots(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        positions = torch.arange(num_tokens, device=self.device)
        table = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def write_sequence(self, blocks: list[int], kv: torch.Tensor, start: int = 0) -> None:
        """Copy a contiguous ``[layers, 2, seq, kv_heads, head_dim]`` KV into ``blocks``, its first
        token at position ``start`` of the sequence."""
        slots = self._slots(blocks, start + kv.shape[2])[start:]
        kv = kv.to(self.device)
        for layer in range(kv.shape[0]):
            self.write(layer, slots, kv[layer, 0], kv[layer, 1])

    def sequence_spec(self, num_tokens: int) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of :meth:`read_sequence`'s tensor."""
        return (len(self.keys), 2, num_tokens, *self.keys[0].shape[2:]), self.keys[0].dtype

    def read_sequence(self, blocks: list[int], num_tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The first ``num_tokens`` of a sequence as one contiguous ``[layers, 2, seq, kv_heads,
        head_dim]`` tensor (the connector payload), written into ``out`` when given (a contiguous
        tensor of :meth:`sequence_spec`, on this cache's device or the host)."""
        index = torch.tensor(blocks[: self.blocks_needed(num_tokens)], dtype=torch.long, device=self.device)
        layers = len(self.keys)
        shape, dtype = self.sequence_spec(num_tokens)
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=self.device)
        elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"read_sequence: out must be a contiguous {dtype} tensor of shape {shape}, "
                             f"got {out.dtype} {tuple(out.shape)}")
        for layer in range(layers):
            self.read_layer_into(layer, blocks, index, num_tokens, out[layer, 0], out[layer, 1])
        return out

    def read_layer_into(self, layer: int, blocks: list[int], index: torch.Tensor, num_tokens: int,
                        keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
        """Copy a sequence's first ``num_tokens`` keys and values of ``layer`` into contiguous
        ``[num_tokens, kv_heads, head_dim]`` tensors (on any device): the whole blocks (``index``:
        the sequence's block ids as a tensor on this device) in one ``index_select`` each, written
        in place, then the used part of a partly filled last block. No intermediate tensor."""
        full, rest = divmod(num_tokens, self.block_size)
        for pool, dst in ((self.keys[layer], keys_out), (self.values[layer], values_out)):
            if full:
                if dst.device == self.device:
                    torch.index_select(pool.view(self.num_blocks, -1), 0, index[:full],
                                       out=dst[: full * self.block_size].view(full, -1))
                else:   # the pool is on an accelerator: gather there, one copy to the host
                    dst[: full * self.block_size].copy_(
                        pool.view(self.num_blocks, -1).index_select(0, index[:full]).view(-1, *pool.shape[2:]))
            if rest:
                dst[full * self.block_size:].copy_(pool[blocks[full]][:rest])

    def gather(self, layer: int, flat_tables: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flattened block tables [B * W] → keys, values [B, W * block_size, kv_heads, head_dim].
        ``index_select`` on the pool viewed as rows of whole blocks: one memcpy per block (advanced
        indexing ``pool[tables]`` is ~9× slower for the same bytes)."""
        pool_k, pool_v = self.keys[layer], self.values[layer]
        shape = (batch, -1, *pool_k.shape[2:])
        keys = pool_k.view(self.num_blocks, -1).index_select(0, flat_tables).view(shape)
        values = pool_v.view(self.num_blocks, -1).index_select(0, flat_tables).view(shape)
        return keys, values
