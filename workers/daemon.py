"""``omni-worker --role encode|prefill|decode|generate --model DIR --broker ENDPOINT``: one worker daemon.

Reads the config, looks up the builder of this role for the model's kind in the role table
(:mod:`omnirelay.workers.role_table`; a role the kind has no builder for exits with status 2 before
anything loads), which loads the model and opens the connector, engine and role adapter; then runs
the runtime until SIGTERM/SIGINT, and drains. Ranks of a GPU group beyond rank 0 never talk to the
broker (tensor/pipeline parallelism is set up inside the engine).

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
import dataclasses
import json
import logging
import os
from typing import Callable

import torch

from omnirelay.pipeline import (ConnectorSpec, PipelineError, default_llm_pipeline, load_pipeline,
                                       parse_pipeline)
from omnirelay.lifecycle import Shutdown, add_logging_arguments, setup_logging
from omnirelay import lora_modules
from omnirelay.model_kind import model_kind
from omnirelay.security import CurveKeys, add_curve_arguments, keys_from_args, require_curve_off_loopback
from omnirelay.tracing import Tracing, add_tracing_arguments, tracing_from_args

from omnirelay.workers.generate.sequence_parallel_group import SequenceParallelGroupLost
from omnirelay.workers.role_table import role_builder
from omnirelay.workers.runtime.assembly import RoleBuilder, closed_on_error
from omnirelay.workers.llm.lora import LoraError
from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.runtime.devices import KVBudgetError, parse_device_ids, resolve_devices
from omnirelay.workers.runtime.health_server import HealthServer
from omnirelay.workers.runtime.loop import WorkerRuntime
from omnirelay.workers.runtime.rank_processes import ParallelGroupLost

log = logging.getLogger("omnirelay.worker")


def build_runtime(config: WorkerConfig, build: RoleBuilder, shutdown: Shutdown | None = None,
                  keys: CurveKeys | None = None, on_fatal: Callable[[str], None] | None = None,
                  tracing: Tracing | None = None) -> WorkerRuntime:
    """The runtime around what ``build`` (this worker's entry of the role table) assembles.
    ``on_fatal(reason)``: called once, from any thread, when the worker can no longer serve (a
    generate worker's sequence-parallel group lost a rank); it should request the shutdown."""
    built = build(config, on_fatal)
    with closed_on_error(*built.owned):
        return WorkerRuntime(config, built.adapter, built.stats, shutdown, keys, owned=built.owned, tracing=tracing)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-worker", description="omnirelay worker daemon")
    parser.add_argument("--role", required=True, choices=["encode", "prefill", "decode", "generate"])
    parser.add_argument("--model", required=True, help="local model directory")
    parser.add_argument("--served-model-name", default=None, help="name requests use (default: --model)")
    parser.add_argument("--broker", default="tcp://127.0.0.1:5555")
    parser.add_argument("--worker-id", default="")
    parser.add_argument("--capacity", type=int, default=0, help="max requests held at once")
    parser.add_argument("--stream-chunk-tokens", type=int, default=None,
                        help="decode: stream a spoken reply to generate in chunks of N tokens (0: whole at the "
                             "end; default: the stage's runtime.stream_chunk_tokens)")
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
    parser.add_argument("--connector-options", default="{}",
                        help="JSON map of backend options (with --stage-configs-path: added to the file's options "
                             "of this worker's connector, e.g. a per-host local_hostname)")
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
    lora_modules.add_arguments(parser)
    parser.add_argument("--kv-transfer", choices=("auto", "layerwise", "whole"), default=None,
                        help="prefill: how the KV leaves (default: the stage's engine_args.kv_transfer, else auto)")
    parser.add_argument("--health-port", type=int, default=None,
                        help="serve GET /live and /ready on this port (0: any free one) for HTTP probes such as "
                             "Kubernetes' (workers/runtime/health_server.py; default: off)")
    parser.add_argument("--health-host", default="127.0.0.1", help="address of the health endpoint")
    add_logging_arguments(parser)
    add_curve_arguments(parser, server=False, client=True)
    add_tracing_arguments(parser)
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
            # --connector-options tops up the file's options for this worker alone: what differs per
            # host, such as Mooncake's local_hostname (the Kubernetes manifests pass the pod's IP).
            connector = dataclasses.replace(connector, options={**connector.options,
                                                                **json.loads(args.connector_options)})
        config = WorkerConfig(
            role=args.role, model_path=os.path.abspath(args.model),
            model_name=args.served_model_name or args.model, broker=args.broker, worker_id=args.worker_id,
            capacity=args.capacity or stage.max_batch_size,
            stream_chunk_tokens=(stage.stream_chunk_tokens if args.stream_chunk_tokens is None
                                 else args.stream_chunk_tokens),
            max_model_len=args.max_model_len, kv_cache_bytes=args.kv_cache_bytes,
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
            expert_parallel=bool(args.enable_expert_parallel or stage.enable_expert_parallel),
            lora=lora_modules.options_from_args(args) or stage.lora)   # the flags, else the stage's keys
        devices = _resolve_worker_devices(config)
        build = role_builder(config.role, model_kind(config.model_path))   # before anything loads
        keys = keys_from_args(args)
        require_curve_off_loopback(keys, config.broker)
        tracing = tracing_from_args(f"omni-worker-{config.role}", args)
    except (ValueError, json.JSONDecodeError, PipelineError) as exc:   # SecurityError, UnsupportedRole included
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
        runtime = build_runtime(config, build, shutdown, keys, on_fatal, tracing)
    except (KVBudgetError, LoraError) as exc:   # LoraError: a bad --lora-modules adapter, named
        parser.error(str(exc))
    except SequenceParallelGroupLost as exc:   # a rank died while starting: its own output is above
        log.error("%s worker %s could not start: %s", config.role, config.worker_id, exc)
        return 1
    print(f"omni-worker {config.role} ready: {config.worker_id}", flush=True)
    health = None
    if args.health_port is not None:
        try:
            health = HealthServer(runtime.health, args.health_host, args.health_port)
        except OSError as exc:   # the port is taken: say so before serving anything
            runtime.close()
            parser.error(f"--health-port {args.health_port}: {exc}")
        health.start()
    try:
        runtime.run()   # a lost rank: the runtime already failed what it held as worker_lost
    except ParallelGroupLost as exc:
        log.error("%s worker %s stopped: %s; exiting with status 1", config.role, config.worker_id, exc)
        return 1
    finally:
        if health is not None:
            health.close()
        if tracing is not None:
            tracing.shutdown()   # after the runtime ended its spans
    if fatal:
        log.error("%s worker %s stopped: %s; exiting with status 1", config.role, config.worker_id, fatal[0])
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
