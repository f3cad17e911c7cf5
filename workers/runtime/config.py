"""Configuration of one worker daemon (one frozen object, validated on construction)."""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from pathlib import Path

from omnirelay.block_hash import DEFAULT_BLOCK_SIZE
from omnirelay.lora_modules import LoraOptions

ROLES = ("encode", "prefill", "decode", "generate")


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """
    role:            which stage this worker serves.
    model_path:      local HF directory of the model (generate: a diffusers pipeline directory).
    model_name:      the name the model is served under (what requests say in ``model``).
    broker:          ZeroMQ endpoint of the broker.
    worker_id:       unique id on the bus (default: role-host-pid-random).
    capacity:        how many requests this worker holds at once (credits it grants).
    max_model_len:   longest sequence (prompt + output); default the model's max positions.
    kv_cache_bytes:  byte budget of the prefill/decode KV block pool; 0: not set (256 MiB on the CPU;
                     on CUDA the pool takes what ``gpu_memory_utilization`` leaves, and a non-zero
                     value caps it — :mod:`omnirelay.workers.runtime.devices`).
    devices:         CUDA device ids of this worker's GPU group, rank i on the i-th (empty: cuda:0..
                     N-1 on a host with CUDA, else the CPU); must number tensor × pipeline (× sequence)
                     parallel size.
    gpu_memory_utilization: on CUDA, the share of each device's memory the worker fills, weights and
                     memory already in use included; the KV pool gets the rest of that share.
    block_size:      tokens per KV block.
    connector:       name of the connector backend for the KV handoff.
    connector_options: the backend's options.
    heartbeat_interval_s: how often to heartbeat the broker.
    wedged_after_s: one engine step this long is a wedged engine: keepalives stop, so the broker
                    drops the worker and re-dispatches what it held (see broker_link.py).
    drain_timeout_s: on SIGTERM, how long in-flight requests may take before they are aborted.
    dtype:           model dtype name (float32, bfloat16, float16).
    tensor_parallel_size: ranks that split heads and MLP columns (rank 0 is this process).
    pipeline_parallel_size: ranks that split the layers into ranges.
    sequence_parallel_size: generate only: ranks that split a diffusion transformer's image tokens
                     (checked against the pipeline directory here, before anything loads).
    max_num_batched_tokens: prefill tokens per engine step (longer prompts are chunked).
    prefix_caching:  prefill reuses KV blocks of earlier prompts with the same prefix.
    kv_transfer:     prefill: ``layerwise`` puts each layer's KV while the later layers compute (a
                     single-process worker; a TP/PP group always exports whole), ``whole`` after the forward,
                     ``auto`` (default) layerwise only for a step with at least 16 MiB of KV to send.
    threads:         torch intra-op threads of each rank.
    stream_chunk_tokens: decode: a spoken reply's states go to the generate stage in chunks of this many
                     new tokens while the reply is written (0: whole, after its last token).
    expert_parallel: prefill/decode of a mixture-of-experts model: the tensor-parallel ranks hold
                     whole experts (contiguous blocks) and exchange tokens by all-to-all instead of
                     each holding a slice of every expert (``--enable-expert-parallel``); the
                     experts must divide by ``tensor_parallel_size`` (checked here, at start-up).
    """

    role: str
    model_path: str
    model_name: str
    broker: str = "tcp://127.0.0.1:5555"
    worker_id: str = ""
    capacity: int = 0
    max_model_len: int = 0
    kv_cache_bytes: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    connector: str = "shared_memory"
    connector_options: dict = dataclasses.field(default_factory=dict)
    heartbeat_interval_s: float = 1.0
    stream_chunk_tokens: int = 0
    wedged_after_s: float = 300.0
    drain_timeout_s: float = 30.0
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_num_batched_tokens: int = 256
    prefix_caching: bool = True
    kv_transfer: str = "auto"
    threads: int = 1
    devices: tuple[int, ...] = ()
    gpu_memory_utilization: float = 0.9
    sequence_parallel_size: int = 1
    expert_parallel: bool = False
    lora: LoraOptions | None = None     # --enable-lora (prefill and decode of a causal LM); None: off

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not os.path.isdir(self.model_path):
            raise ValueError(f"model directory {self.model_path!r} does not exist")
        if self.kv_transfer not in ("auto", "layerwise", "whole"):
            raise ValueError(f"kv_transfer must be 'auto', 'layerwise' or 'whole', got {self.kv_transfer!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.wedged_after_s <= 2 * self.heartbeat_interval_s:
            raise ValueError(f"--wedged-after {self.wedged_after_s} must exceed two heartbeat intervals "
                             f"({2 * self.heartbeat_interval_s} s): a slow step is not a wedged one")
        if self.capacity < 0 or self.block_size < 1 or self.kv_cache_bytes < 0 or self.stream_chunk_tokens < 0:
            raise ValueError("capacity and block_size must be positive, kv_cache_bytes not negative")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: must be in (0, 1]")
        group = self.tensor_parallel_size * self.pipeline_parallel_size * self.sequence_parallel_size
        if self.devices and len(self.devices) != group:
            raise ValueError(f"--devices {','.join(map(str, self.devices))} names {len(self.devices)} device(s) but "
                             f"the group is --tensor-parallel-size {self.tensor_parallel_size} × "
                             f"--pipeline-parallel-size {self.pipeline_parallel_size}"
                             + (f" × --sequence-parallel-size {self.sequence_parallel_size}"
                                if self.sequence_parallel_size > 1 else "") + f" = {group}")
        if min(self.tensor_parallel_size, self.pipeline_parallel_size, self.sequence_parallel_size,
               self.max_num_batched_tokens, self.threads) < 1:
            raise ValueError("parallel sizes, max_num_batched_tokens and threads must be >= 1")
        if self.sequence_parallel_size != 1:
            if self.role != "generate":
                raise ValueError(f"sequence_parallel_size {self.sequence_parallel_size}: only generate workers "
                                 "(diffusion transformers) run sequence parallelism")
            from omnirelay.workers.generate.sequence_parallel_group import check_sequence_parallel   # torch: only when asked for
            check_sequence_parallel(self.model_path, self.sequence_parallel_size)
        if self.expert_parallel:
            if self.role not in ("prefill", "decode"):
                raise ValueError(f"--enable-expert-parallel: only prefill and decode workers run a language model, "
                                 f"not {self.role}")
            from omnirelay.workers.llm.expert_parallel import check_expert_parallel   # torch: only when asked for
            from omnirelay.workers.llm.models.llama import LlamaConfig
            check_expert_parallel(LlamaConfig.from_dir(Path(self.model_path)).moe, self.tensor_parallel_size)
        if not self.worker_id:
            object.__setattr__(self, "worker_id",
                               f"{self.role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        if not self.capacity:
            object.__setattr__(self, "capacity", 64 if self.role == "decode" else 8)
