"""The prefill and decode role builders (entries of :mod:`omnirelay.workers.role_table`).

Both load the model into this process, or start a TP × PP group whose rank 0 this process is
(:func:`model_runner`), open the connector the KV travels by, and keep one structured-output compile
cache over the model's tokenizer; then each builds its engine and role adapter. The runtime closes,
in order after the engine (its transfer threads use the connector), the connector and the
runner (which stops ranks 1..N-1 of a parallel group).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from omnirelay.mrope import MropeSpec

from omnirelay.connectors.timing import TimedConnector
from omnirelay.workers.llm.decode import DecodeEngine
from omnirelay.workers.llm.lora import LoraSlots
from omnirelay.workers.llm.model_runner import ModelRunner, local_runner
from omnirelay.workers.llm.models.llama import LlamaConfig, LlamaModel
from omnirelay.workers.llm.prefill import PrefillEngine
from omnirelay.workers.llm.structured_output import GrammarCompilerCache, GrammarSampler
from omnirelay.workers.runtime.assembly import BuiltRole, closed_on_error, connector_stats, open_connector
from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.runtime.devices import resolve_devices
from omnirelay.workers.llm.parallel import GroupConfig, GroupRunner
from omnirelay.process_memory import release_freed_heap
from omnirelay.workers.llm.roles import DecodeRole, PrefillRole

log = logging.getLogger("omnirelay.worker")


@dataclass(frozen=True)
class _LLMParts:
    """What prefill and decode workers both start with."""

    runner: ModelRunner
    connector: TimedConnector
    grammars: GrammarSampler
    max_model_len: int

    @classmethod
    def open(cls, config: WorkerConfig) -> "_LLMParts":
        runner = model_runner(config)
        with closed_on_error(runner):
            model_cfg = runner.config
            max_model_len = config.max_model_len or model_cfg.max_position_embeddings
            if max_model_len > model_cfg.max_position_embeddings:
                raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                                 f"max_position_embeddings {model_cfg.max_position_embeddings}")
            connector = open_connector(config)
        # Structured outputs: one compile cache per worker over the model's tokenizer (loaded on first use).
        grammars = GrammarSampler(GrammarCompilerCache(config.model_path, model_cfg.vocab_size,
                                                       model_cfg.eos_token_ids))
        return cls(runner, connector, grammars, max_model_len)



def build_prefill_role(config: WorkerConfig, on_fatal: Callable[[str], None] | None = None) -> BuiltRole:
    """A prefill worker: chunked prefill up to ``config.max_num_batched_tokens`` a step, the prefix
    cache unless ``config.prefix_caching`` is off, the KV out as ``config.kv_transfer`` says."""
    llm = _LLMParts.open(config)
    with closed_on_error(llm.connector, llm.runner):
        mrope = MropeSpec.from_config(json.loads((Path(config.model_path) / "config.json").read_text()))
        engine = PrefillEngine(llm.runner, llm.connector, max_model_len=llm.max_model_len, max_batch=config.capacity,
                               max_batched_tokens=config.max_num_batched_tokens, prefix_caching=config.prefix_caching,
                               kv_transfer=config.kv_transfer, mrope=mrope, grammars=llm.grammars,
                               lora=_lora_slots(config, llm.runner))
    _log_ready(config, llm)
    return BuiltRole(PrefillRole(config.worker_id, engine), _stats(engine, llm, prefill=True),
                     owned=(llm.connector, llm.runner))


def build_decode_role(config: WorkerConfig, on_fatal: Callable[[str], None] | None = None) -> BuiltRole:
    """A decode worker: continuous batching of up to ``config.capacity`` sequences."""
    llm = _LLMParts.open(config)
    with closed_on_error(llm.connector, llm.runner):
        engine = DecodeEngine(llm.runner, llm.connector, max_num_seqs=config.capacity,
                              max_model_len=llm.max_model_len, grammars=llm.grammars,
                              stream_chunk_tokens=config.stream_chunk_tokens, lora=_lora_slots(config, llm.runner),
                              speculative=config.speculative)
    _log_ready(config, llm)
    # The engine first: closing it joins its KV import threads, which use the connector.
    return BuiltRole(DecodeRole(config.worker_id, engine), _stats(engine, llm, prefill=False),
                     owned=(llm.connector, llm.runner))


def _lora_slots(config: WorkerConfig, runner: ModelRunner) -> LoraSlots | None:
    """The worker's LoRA slots (``--enable-lora``): every ``--lora-modules`` adapter of this model
    is read and checked now, so a bad one stops the worker at start, naming it."""
    if config.lora is None:
        return None
    options = config.lora
    modules = {m.name: m.path for m in options.modules if m.base_model_name in ("", config.model_name)}
    # A parallel group's other ranks load each adapter rank 0 puts in a slot (their shards).
    return LoraSlots(runner.model, modules, max_loras=options.max_loras, max_rank=options.max_lora_rank,
                     max_cpu_loras=options.max_cpu_loras or None,
                     peers=None if runner.in_process else runner.load_lora)


# Which linear kernels each role's model runs (LlamaModel's ``kernels``). Decode steps are small
# batches, bound by reading the weights: packed for oneDNN, 2-3x faster in bf16, worth a private copy.
# Prefill steps are large batches, bound by arithmetic: in bf16 (and float16), F.linear on the
# checkpoint's own memory map is within 10-20 % of packed there and keeps its weights shared pages of
# the file, so a prefill and a decode worker of one host hold one private copy of the weights between
# them, not two (BENCHMARKS.md). In float32 packing still gains ~1.25x at prefill sizes, and float32
# checkpoints are the tiny test models, so a float32 prefill keeps packing.
ROLE_KERNELS = {"prefill": "mapped", "decode": "auto"}
MAPPED_DTYPES = ("bfloat16", "float16")


def role_kernels(role: str, dtype: str, device: str, int8: bool = False) -> str:
    """LlamaModel's ``kernels`` for this role's model (see ROLE_KERNELS). ``int8``: the linears run
    int8 (a W8A8 checkpoint or --quantization int8), where in-place weights are the fastest prefill
    path in every compute dtype (workers/llm/quantization.py, Int8Linear)."""
    if torch.device(device).type != "cpu" or (dtype not in MAPPED_DTYPES and not int8):
        return "auto"
    return ROLE_KERNELS.get(role, "auto")


def model_runner(config: WorkerConfig) -> ModelRunner:
    """This process's model and KV pool, or rank 0 of a TP × PP group whose other ranks it starts."""
    devices = resolve_devices(config.devices, config.tensor_parallel_size * config.pipeline_parallel_size)
    if len(devices) == 1:
        stored = LlamaConfig.from_dir(Path(config.model_path)).weight_quant
        int8 = config.quantization == "int8" or (stored is not None and stored.int8_kernel)
        model = LlamaModel(config.model_path, dtype=getattr(torch, config.dtype), device=devices[0],
                           kernels=role_kernels(config.role, config.dtype, devices[0], int8),
                           quantization=config.quantization)
        release_freed_heap()
        return local_runner(model, block_size=config.block_size, budget_bytes=config.kv_cache_bytes,
                            gpu_memory_utilization=config.gpu_memory_utilization)
    group = GroupConfig(config.model_path, tp_size=config.tensor_parallel_size,
                        pp_size=config.pipeline_parallel_size, dtype=config.dtype, block_size=config.block_size,
                        threads=config.threads, devices=devices, kv_cache_bytes=config.kv_cache_bytes,
                        gpu_memory_utilization=config.gpu_memory_utilization, expert_parallel=config.expert_parallel,
                        max_loras=config.lora.max_loras if config.lora else 0,
                        max_lora_rank=config.lora.max_lora_rank if config.lora else 0,
                        quantization=config.quantization)
    return GroupRunner(group)


def _stats(engine: PrefillEngine | DecodeEngine, llm: _LLMParts, *, prefill: bool) -> Callable[[], dict]:
    """Heartbeat stats: the engine's queues and counters, the KV pool (and, for prefill, the blocks
    its prefix cache holds), the grammar cache's figures and the connector's."""
    def stats() -> dict:
        cached = ({"prefix_cached_blocks": engine.allocator.num_cached, "sending": engine.num_sending}
                  if prefill else {})
        return {"running": len(engine.running), "waiting": len(engine.waiting),
                "free_kv_blocks": engine.allocator.free, "kv_blocks_total": llm.runner.num_blocks - 1,
                **cached, **engine.stats, **llm.grammars.stats, **connector_stats(llm.connector)}

    return stats


def _log_ready(config: WorkerConfig, llm: _LLMParts) -> None:
    log.info("%s worker %s ready: model %s (%s), max_model_len %d", config.role, config.worker_id,
             config.model_path, config.dtype, llm.max_model_len)
