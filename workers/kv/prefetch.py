"""Decode's KV import as a transfer job: new requests' KVs arrive while the batch keeps stepping.

The threads, states, memory bound and clean-up rules are the shared
:class:`~omnirelay.workers.runtime.transfers.TransferPool`'s; this module says what one import does
(:class:`KVImport`) and makes decode's pool (:func:`kv_prefetcher`). Only the connector work moves
off the step thread: writing the KV into the paged pool (``runner.write_kv``) stays on it, and the
imports run in rank 0's process like before (a TP/PP group's other ranks never touch the connector).

One import, in the pool's states: RUNNING is ``import_kv`` (the gets, the layerwise assembly, the
deletes of every key); READY holds the full-head KV on the host; the engine takes it and writes it
into its blocks. Discarded (cancelled, or failed) it releases its keys unless the import already
deleted them: nobody will read them. The broker either fails the request or restarts it from
prefill under a new attempt, whose KV goes under new keys (``kv/<request_id>/<attempt>``); left
alone, this attempt's KV (a get that timed out while the key arrived late, a get that failed while
the key was there) would hold shared memory or store space until the TTL.

Memory: decode passes ``max_held = max_num_seqs``, so host memory for KVs in waiting is at most one
full batch of admissions (``max_num_seqs`` × the largest KV, ``max_model_len`` tokens); a READY KV
from the ``shared_memory`` connector may be a view of the producer's segment, which the bound caps
too. The layerwise assembly buffers (:class:`~omnirelay.workers.kv.export.StagingBuffer`, warm
memory reused across imports) are the pool's per-thread scratch: a READY KV keeps its buffer until
the engine has written it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from omnirelay.connectors import Connector
from omnirelay.connectors.base import Handle
from omnirelay.errors import OmniError
from omnirelay.handoffs import release_kv
from omnirelay.workers.kv.export import StagingBuffer, import_kv
from omnirelay.workers.runtime.transfers import TransferPool


@dataclasses.dataclass
class KVImport:
    """The import of the KV prefill put under ``name`` (a whole tensor or a layerwise manifest)."""

    name: str            # the KV's connector key
    handle: Handle | None
    num_tokens: int      # the prompt length the KV must cover
    deadline: float
    layers: int | None = None   # its layout (KVHandoff.layers; None: read it) for deleting it unread
    writes_only: ClassVar[bool] = False   # a get: waits for the key, always on a transfer thread

    def run(self, connector: Connector, timeout: float, scratch: StagingBuffer | None) -> torch.Tensor:
        kv = import_kv(connector, self.name, self.handle, timeout=timeout, staging=scratch)
        if kv.shape[2] != self.num_tokens:
            raise OmniError(f"KV under {self.name!r} covers {kv.shape[2]} tokens, prompt has {self.num_tokens}")
        return kv

    def discard(self, connector: Connector, result: torch.Tensor | None) -> None:
        if result is None:   # an import that returned has deleted every key already
            release_kv(connector, self.name, self.handle, layers=self.layers)


def kv_prefetcher(connector: Connector, *, timeout_s: float, max_held: int, threads: int = 2) -> TransferPool:
    """Decode's import pool: ``threads`` import threads, each with its assembly buffer."""
    return TransferPool(connector, timeout_s=timeout_s, max_held=max_held, threads=threads, scratch=StagingBuffer,
                        name="kv-import")
