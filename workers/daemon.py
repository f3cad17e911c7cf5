"""``omni-worker --role encode|prefill|decode|generate --model DIR --broker ENDPOINT``: one worker daemon.

Builds the worker's parts in order — config, model, connector, engine, role adapter, runtime — and
runs the runtime until SIGTERM/SIGINT, then drains. Ranks of a GPU group beyond rank 0 never talk
to the broker (tensor/pipeline parallelism is set up inside the engine).

Devices (:mod:`omnirelay.workers.runtime.devices`): ``--devices 0,1`` puts rank i of a prefill/decode group
on ``cuda:<i-th id>``; without it a host with CUDA uses cuda:0..N-1 and a host without runs on the
CPU. ``--devices`` on a host without CUDA, or a list that does not number TP × PP (× SP for a
generate worker; its SP group runs on the CPU, so it then refuses any list), exits with status 2
before anything loads; so does a KV pool that ``--gpu-memory-utilization`` /
``--kv-cache-bytes`` leave too small, once the weights are loaded. Encode and generate workers keep
their own placement (the first listed device becomes the current CUDA device).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Callable

import torch

from omnirelay.connectors import create_connector
from omnirelay.connectors.timing import TimedConnector
from omnirelay.pipeline import (ConnectorSpec, PipelineError, default_llm_pipeline, load_pipeline,
                                       parse_pipeline)
from omnirelay.lifecycle import Shutdown, add_logging_arguments, setup_logging
from omnirelay.model_kind import ModelKind, model_kind
from omnirelay.security import CurveKeys, add_curve_arguments, keys_from_args, require_curve_off_loopback

from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.llm.decode import DecodeEngine
from omnirelay.workers.runtime.devices import KVBudgetError, parse_device_ids, resolve_devices
from omnirelay.workers.encode.role import build_encode_role
from omnirelay.workers.generate.image_role import build_generate_role
from omnirelay.workers.generate.video_role import build_generate_video_role
from omnirelay.workers.llm.model_runner import ModelRunner, local_runner
from omnirelay.workers.llm.models.llama import LlamaModel
from omnirelay.mrope import MropeSpec
from omnirelay.workers.runtime.parallel import GroupConfig, GroupRunner, ParallelGroupLost
from omnirelay.workers.llm.prefill import PrefillEngine
from omnirelay.workers.speech.qwen3_tts_role import build_qwen3_tts_role
from omnirelay.workers.runtime.roles import DecodeRole, PrefillRole
from omnirelay.workers.runtime.loop import WorkerRuntime
from omnirelay.workers.generate.sequence_parallel_group import SequenceParallelGroupLost
from omnirelay.workers.speech.role import build_speech_role
from omnirelay.workers.llm.structured_output import GrammarCompilerCache, GrammarSampler

log = logging.getLogger("omnirelay.worker")


def build_runtime(config: WorkerConfig, shutdown: Shutdown | None = None,
                  keys: CurveKeys | None = None, on_fatal: Callable[[str], None] | None = None) -> WorkerRuntime:
    """``on_fatal(reason)``: called once, from any thread, when the worker can no longer serve
    (a generate worker's sequence-parallel group lost a rank); it should request the shutdown."""
    if config.role == "encode":   # Qwen2.5-Omni's vision and audio encoders; embeddings out by connector
        connector = TimedConnector(create_connector(config.connector, config.connector_options))
        role, stats = build_encode_role(config, connector)
        return WorkerRuntime(config, role, stats, shutdown, keys, owned=(connector,))
    kind = model_kind(config.model_path)
    if config.role == "generate" and kind is ModelKind.QWEN3_TTS:   # Qwen3-TTS: text in, no connector
        role, stats = build_qwen3_tts_role(config)
        return WorkerRuntime(config, role, stats, shutdown, keys, owned=(role.engine,))
    if config.role == "generate" and kind.is_omni:   # Qwen2.5-Omni / Qwen3-Omni: talker + vocoder
        connector = TimedConnector(create_connector(config.connector, config.connector_options))
        role, stats = build_speech_role(config, connector)
        # The engine first: closing it joins its synthesis thread before the connector goes.
        return WorkerRuntime(config, role, stats, shutdown, keys, owned=(role.engine, connector))
    if config.role == "generate" and kind is ModelKind.TEXT_TO_VIDEO:   # no KV cache, no connector yet
        role, stats = build_generate_video_role(config, on_lost=on_fatal)
        # Owned: closing the group stops ranks 1..N-1 of a sequence-parallel Wan worker.
        owned = (role.sequence_parallel,) if role.sequence_parallel is not None else ()
        return WorkerRuntime(config, role, stats, shutdown, keys, owned=owned)
    if config.role == "generate":   # a text-to-image diffusers pipeline directory
        role, stats = build_generate_role(config, on_lost=on_fatal)
        # The engine is owned: closing it stops ranks 1..N-1 of a sequence-parallel group.
        return WorkerRuntime(config, role, stats, shutdown, keys, owned=(role.engine,))
    runner = _model_runner(config)
    model_cfg = runner.config
    max_model_len = config.max_model_len or model_cfg.max_position_embeddings
    if max_model_len > model_cfg.max_position_embeddings:
        runner.close()
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                         f"max_position_embeddings {model_cfg.max_position_embeddings}")
    connector = TimedConnector(create_connector(config.connector, config.connector_options))
    # Structured outputs: one compile cache per worker over the model's tokenizer (loaded on first use).
    grammars = GrammarSampler(GrammarCompilerCache(config.model_path, model_cfg.vocab_size, model_cfg.eos_token_ids))
    if config.role == "prefill":
        engine = PrefillEngine(runner, connector, max_model_len=max_model_len,
                               max_batched_tokens=config.max_num_batched_tokens, prefix_caching=config.prefix_caching,
                               kv_transfer=config.kv_transfer,
                               mrope=MropeSpec.from_config(json.loads((Path(config.model_path) / "config.json").read_text())),
                               grammars=grammars)
        role = PrefillRole(config.worker_id, engine)
        closes_first: tuple = ()

        def stats() -> dict:
            return {"running": len(engine.running), "waiting": len(engine.waiting),
                    "free_kv_blocks": engine.allocator.free, "kv_blocks_total": runner.num_blocks - 1,
                    "prefix_cached_blocks": engine.allocator.num_cached, **engine.stats, **grammars.stats,
                    **_connector_stats(connector)}
    else:
        engine = DecodeEngine(runner, None, connector, max_num_seqs=config.capacity, max_model_len=max_model_len,
                              grammars=grammars)
        role = DecodeRole(config.worker_id, engine)
        closes_first = (engine,)   # joins its KV import threads, which use the connector

        def stats() -> dict:
            return {"running": len(engine.running), "waiting": len(engine.waiting),
                    "free_kv_blocks": engine.allocator.free, "kv_blocks_total": runner.num_blocks - 1,
                    **engine.stats, **grammars.stats, **_connector_stats(connector)}
    log.info("%s worker %s ready: model %s (%s), max_model_len %d", config.role, config.worker_id,
             config.model_path, config.dtype, max_model_len)
    # The runner is owned too: closing it stops ranks 1..N-1 of a parallel group.
    return WorkerRuntime(config, role, stats, shutdown, keys, owned=(*closes_first, connector, runner))


def _model_runner(config: WorkerConfig) -> ModelRunner:
    """This process's model and KV pool, or rank 0 of a TP × PP group whose other ranks it starts."""
    devices = resolve_devices(config.devices, config.tensor_parallel_size * config.pipeline_parallel_size)
    if len(devices) == 1:
        model = LlamaModel(config.model_path, dtype=getattr(torch, config.dtype), device=devices[0])
        return local_runner(model, block_size=config.block_size, budget_bytes=config.kv_cache_bytes,
                            gpu_memory_utilization=config.gpu_memory_utilization)
    group = GroupConfig(config.model_path, tp_size=config.tensor_parallel_size,
                        pp_size=config.pipeline_parallel_size, dtype=config.dtype, block_size=config.block_size,
                        threads=config.threads, devices=devices, kv_cache_bytes=config.kv_cache_bytes,
                        gpu_memory_utilization=config.gpu_memory_utilization, expert_parallel=config.expert_parallel)
    return GroupRunner(group)


def _resolve_worker_devices(config: WorkerConfig) -> tuple[str, ...]:
    """The group's devices, or ValueError. A sequence-parallel group runs on the CPU (gloo) in this
    build: a device list for it is checked as any other (so a host without CUDA fails as the LLM
    workers do) and then refused rather than ignored; without one it needs no CUDA devices."""
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    sp = config.sequence_parallel_size
    if sp == 1:
        return resolve_devices(config.devices, world)
    if config.devices:
        resolve_devices(config.devices, world * sp)
        raise ValueError(f"--devices {','.join(map(str, config.devices))}: the {sp} sequence-parallel ranks run on the "
                         "CPU (gloo) in this build and cannot use CUDA devices yet; leave --devices out")
    return ("cpu",) * world


def _connector_stats(connector) -> dict:
    return {f"connector_{k}": v for k, v in connector.health().items() if isinstance(v, (int, float))
            and not isinstance(v, bool)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-worker", description="omnirelay worker daemon")
    parser.add_argument("--role", required=True, choices=["encode", "prefill", "decode", "generate"])
    parser.add_argument("--model", required=True, help="local model directory")
    parser.add_argument("--served-model-name", default=None, help="name requests use (default: --model)")
    parser.add_argument("--broker", default="tcp://127.0.0.1:5555")
    parser.add_argument("--worker-id", default="")
    parser.add_argument("--capacity", type=int, default=0, help="max requests held at once")
    parser.add_argument("--max-model-len", type=int, default=0)
    parser.add_argument("--kv-cache-bytes", type=int, default=WorkerConfig.kv_cache_bytes,
                        help="KV pool bytes (CPU default 256 MiB); on CUDA a cap on the utilization share")
    parser.add_argument("--devices", default=None, help="CUDA device ids of this worker's group, e.g. 0,1")
    parser.add_argument("--gpu-memory-utilization", type=float, default=WorkerConfig.gpu_memory_utilization,
                        help="CUDA: share of each device's memory to fill (weights, KV, memory in use)")
    parser.add_argument("--block-size", type=int, default=WorkerConfig.block_size)
    parser.add_argument("--stage-configs-path", default=None,
                        help="stage-pipeline YAML; its edge names this worker's connector")
    parser.add_argument("--connector", default="shared_memory", help="connector backend without a pipeline file")
    parser.add_argument("--connector-options", default="{}", help="JSON map of backend options")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--drain-timeout", type=float, default=WorkerConfig.drain_timeout_s)
    parser.add_argument("--heartbeat-interval", type=float, default=WorkerConfig.heartbeat_interval_s)
    parser.add_argument("--wedged-after", type=float, default=WorkerConfig.wedged_after_s,
                        help="seconds one engine step may run before the worker counts as wedged and stops "
                             "heartbeating (the broker then re-dispatches its work)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (per rank)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks splitting heads and MLP")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1, help="ranks splitting the layers")
    parser.add_argument("--enable-expert-parallel", action="store_true", default=None,
                        help="MoE models: the tensor-parallel ranks hold whole experts (contiguous blocks) and "
                             "exchange tokens by all-to-all (default: the stage's engine_args.enable_expert_parallel)")
    parser.add_argument("--sequence-parallel-size", type=int, default=None,
                        help="generate: ranks splitting a diffusion transformer's image or video tokens "
                             "(SD3, Z-Image, Wan; default: the stage's engine_args.sequence_parallel_size, else 1)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=WorkerConfig.max_num_batched_tokens,
                        help="prefill tokens per step; longer prompts are chunked")
    parser.add_argument("--no-prefix-caching", action="store_true", help="prefill recomputes every prompt")
    parser.add_argument("--kv-transfer", choices=("auto", "layerwise", "whole"), default=None,
                        help="prefill: how the KV leaves (default: the stage's engine_args.kv_transfer, else auto)")
    add_logging_arguments(parser)
    add_curve_arguments(parser, server=False, client=True)
    args = parser.parse_args(argv)
    setup_logging(f"omni-worker-{args.role}", args.log_level, args.log_format)
    # Several workers share the host's cores; one thread each keeps them from starving each other.
    torch.set_num_threads(args.threads)
    try:
        if args.stage_configs_path:
            pipeline = load_pipeline(args.stage_configs_path)
        elif args.role == "generate":   # text to image: one stage, nothing flows in
            pipeline = parse_pipeline({"stages": [{"name": "generate", "role": "generate"}]})
        else:
            pipeline = default_llm_pipeline(args.connector, json.loads(args.connector_options))
        stage = pipeline.stage_for_role(args.role)
        if args.role == "generate" and not any(stage.name in (e.source, e.target) for e in pipeline.edges):
            connector = ConnectorSpec("none", args.connector, json.loads(args.connector_options))
        else:
            connector = pipeline.connector_for(args.role)
        config = WorkerConfig(
            role=args.role, model_path=os.path.abspath(args.model),
            model_name=args.served_model_name or args.model, broker=args.broker, worker_id=args.worker_id,
            capacity=args.capacity or stage.max_batch_size, max_model_len=args.max_model_len, kv_cache_bytes=args.kv_cache_bytes,
            block_size=args.block_size, connector=connector.type,
            connector_options=connector.options, heartbeat_interval_s=args.heartbeat_interval,
            wedged_after_s=args.wedged_after,
            drain_timeout_s=args.drain_timeout, dtype=args.dtype,
            tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
            max_num_batched_tokens=args.max_num_batched_tokens, prefix_caching=not args.no_prefix_caching,
            threads=args.threads, kv_transfer=args.kv_transfer or stage.kv_transfer,
            devices=parse_device_ids(args.devices) if args.devices is not None else (),
            gpu_memory_utilization=args.gpu_memory_utilization,
            sequence_parallel_size=(stage.sequence_parallel_size if args.sequence_parallel_size is None
                                    else args.sequence_parallel_size),
            expert_parallel=bool(args.enable_expert_parallel or stage.enable_expert_parallel))
        devices = _resolve_worker_devices(config)
        keys = keys_from_args(args)
        require_curve_off_loopback(keys, config.broker)
    except (ValueError, json.JSONDecodeError, PipelineError) as exc:   # SecurityError included
        parser.error(str(exc))
    shutdown = Shutdown().install()
    if config.role not in ("prefill", "decode") and devices[0].startswith("cuda"):
        torch.cuda.set_device(devices[0])   # roles that place themselves on "cuda" land on the group's first
    # A worker that can no longer serve says why here; it then drains and unregisters as on SIGTERM
    # (its engine has already failed what it held) and exits 1, so that its supervisor restarts it.
    fatal: list[str] = []

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        shutdown.request()

    try:
        runtime = build_runtime(config, shutdown, keys, on_fatal)
    except KVBudgetError as exc:
        parser.error(str(exc))
    except SequenceParallelGroupLost as exc:   # a rank died while starting: its own output is above
        log.error("%s worker %s could not start: %s", config.role, config.worker_id, exc)
        return 1
    print(f"omni-worker {config.role} ready: {config.worker_id}", flush=True)
    try:
        runtime.run()   # a lost rank: the runtime already failed what it held as worker_lost
    except ParallelGroupLost as exc:
        log.error("%s worker %s stopped: %s; exiting with status 1", config.role, config.worker_id, exc)
        return 1
    if fatal:
        log.error("%s worker %s stopped: %s; exiting with status 1", config.role, config.worker_id, fatal[0])
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
