"""The engines' one handle on the model and its KV pool, wherever the ranks are.

An engine (prefill, decode) schedules and owns the block allocator; it runs steps and moves KV in
and out only through a :class:`ModelRunner`:

* :class:`LocalRunner` — the whole model and pool in this process.
* :class:`~omnirelay.workers.llm.parallel.GroupRunner` — rank 0 of a tensor/pipeline-parallel group:
  the same calls, broadcast to the other ranks, each holding its heads and layers.

KV crosses the runner boundary as full-head ``[layers, 2, seq, kv_heads, head_dim]`` tensors, so
the connector payload does not depend on how either side is sharded: a TP=2 prefill gathers heads
on export and a TP=1 (or TP=4) decode splits them on import.

Devices: the model, its pool and each step's tensors live on the rank's device (CPU or
``cuda:<id>``, :mod:`omnirelay.workers.runtime.devices`). Engines hand the runner CPU tensors; the runner
moves a step's batch to the device once. What crosses back is what the engine needs on the host:
``read_kv`` returns a CPU tensor (the connector contract takes host memory), ``write_kv`` accepts one.
``forward`` returns logits on the device: the sampler reads the greedy tokens with one ``tolist``
and copies rows to the host only for random sampling (:func:`~omnirelay.workers.llm.sampling.logits_for_sampling`).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from omnirelay.workers.runtime.devices import DEFAULT_GPU_MEMORY_UTILIZATION, blocks_in_budget, rank_kv_budget
from omnirelay.workers.llm.forward_batch import ForwardBatch
from omnirelay.workers.kv.cache import PagedKVCache
from omnirelay.workers.kv.export import LayerwiseExport
from omnirelay.workers.llm.models.llama import HiddenCapture, LlamaConfig, LlamaModel
from omnirelay.workers.llm.prompt_logprobs import PromptCapture
from omnirelay.request_params import TextParams


class ModelRunner(Protocol):
    config: LlamaConfig
    block_size: int
    num_blocks: int
    # The whole model and pool in this process: what a step needs beyond token ids and positions
    # (media embeddings, captured hidden states, a per-layer hook) can reach the layers. A parallel
    # group's broadcast carries token ids and positions only.
    in_process: bool

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[B, vocab]`` (float32, on rank 0's device) of each sequence's last new token;
        writes the new tokens' KV. ``batch`` may be on the CPU."""

    def kv_spec(self, num_tokens: int) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of :meth:`read_kv`'s tensor for ``num_tokens`` tokens."""

    def read_kv(self, blocks: list[int], num_tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """A sequence's KV, all heads, as one contiguous CPU tensor; written into ``out`` (a
        contiguous CPU tensor of :meth:`kv_spec`, e.g. connector memory lent by ``reserve``) and
        returned when given."""

    def write_kv(self, blocks: list[int], kv: torch.Tensor, start: int = 0) -> None:
        """Store a full-head KV tensor (any device) into ``blocks`` from sequence position ``start``."""

    def close(self) -> None:
        """Stop the other ranks (no-op for a local runner)."""


class LocalRunner:
    in_process = True

    def __init__(self, model: LlamaModel, cache: PagedKVCache):
        self.model = model
        self.cache = cache
        self.config = model.config
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one token takes in the pool (all layers, all heads)."""
        return self.cache.bytes_per_block // self.block_size

    def layerwise_export(self, connector, sequences: list) -> LayerwiseExport:
        """An export that puts each layer of ``sequences`` (:class:`ExportSequence`) as the forward
        finishes it (:mod:`~omnirelay.workers.kv.export`; in-process runners only: a group's layers
        are on other ranks)."""
        return LayerwiseExport(connector, self.cache, sequences, len(self.model.layers))

    def forward(self, batch: ForwardBatch, on_layer: Callable[[int], None] | None = None,
                capture: HiddenCapture | None = None, prompt: PromptCapture | None = None) -> torch.Tensor:
        """``on_layer``, ``capture``, ``prompt``: see :meth:`LlamaModel.forward` (in-process runners
        only: a group's layers are on other ranks, so the prefill exports a group's KV whole, and
        speech and prompt logprobs need a single-process worker)."""
        return self.model.forward(batch.to(self.model.device), self.cache, on_layer=on_layer, capture=capture,
                                  prompt=prompt)

    def kv_spec(self, num_tokens: int) -> tuple[tuple[int, ...], torch.dtype]:
        return self.cache.sequence_spec(num_tokens)

    def read_kv(self, blocks: list[int], num_tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return self.cache.read_sequence(blocks, num_tokens).cpu()
        return self.cache.read_sequence(blocks, num_tokens, out=out)   # from any device's pool into out

    def write_kv(self, blocks: list[int], kv: torch.Tensor, start: int = 0) -> None:
        self.cache.write_sequence(blocks, kv, start)

    def close(self) -> None:
        pass


def local_runner(model: LlamaModel, *, block_size: int, budget_bytes: int = 0,
                 gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION) -> LocalRunner:
    """A pool on the model's device, sized after the model is loaded (:func:`rank_kv_budget`:
    ``budget_bytes`` on the CPU, 0 for the default; on CUDA the utilization share, capped by
    ``budget_bytes`` when non-zero)."""
    cfg = model.config
    budget, where = rank_kv_budget(model.device, gpu_memory_utilization, budget_bytes)
    per_block = PagedKVCache.block_bytes(len(model.layers), model.num_kv_heads, cfg.head_dim, block_size, model.dtype)
    cache = PagedKVCache(len(model.layers), model.num_kv_heads, cfg.head_dim, block_size=block_size,
                         num_blocks=blocks_in_budget(budget, per_block, where), dtype=model.dtype, device=model.device)
    return LocalRunner(model, cache)
