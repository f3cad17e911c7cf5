"""The engines' one handle on the model and its KV pool, wherever the ranks are.

An engine (prefill, decode) schedules and owns the block allocator; it runs steps and moves KV in
and out only through a :class:`ModelRunner`:

* :class:`LocalRunner` — the whole model and pool in this process.
* :class:`~omnirelay.workers.parallel.GroupRunner` — rank 0 of a tensor/pipeline-parallel group:
  the same calls, broadcast to the other ranks, each holding its heads and layers.

KV crosses the runner boundary as full-head ``[layers, 2, seq, kv_heads, head_dim]`` tensors, so
the connector payload does not depend on how either side is sharded: a TP=2 prefill gathers heads
on export and a TP=1 (or TP=4) decode splits them on import.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .forward_batch import ForwardBatch
from .kv_cache import PagedKVCache
from .models.llama import LlamaConfig, LlamaModel


class ModelRunner(Protocol):
    config: LlamaConfig
    block_size: int
    num_blocks: int

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[B, vocab]`` of each sequence's last new token; writes the new tokens' KV."""

    def read_kv(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """A sequence's KV, all heads, as one contiguous tensor."""

    def write_kv(self, blocks: list[int], kv: torch.Tensor, start: int = 0) -> None:
        """Store a full-head KV tensor into ``blocks`` from sequence position ``start``."""

    def close(self) -> None:
        """Stop the other ranks (no-op for a local runner)."""


class LocalRunner:
    def __init__(self, model: LlamaModel, cache: PagedKVCache):
        self.model = model
        self.cache = cache
        self.config = model.config
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.forward(batch, self.cache)

    def read_kv(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        return self.cache.read_sequence(blocks, num_tokens)

    def write_kv(self, blocks: list[int], kv: torch.Tensor, start: int = 0) -> None:
        self.cache.write_sequence(blocks, kv, start)

    def close(self) -> None:
        pass


def local_runner(model: LlamaModel, *, block_size: int, budget_bytes: int) -> LocalRunner:
    cfg = model.config
    cache = PagedKVCache(len(model.layers), model.num_kv_heads, cfg.head_dim, block_size=block_size,
                         budget_bytes=budget_bytes, dtype=model.dtype)
    return LocalRunner(model, cache)
