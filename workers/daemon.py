"""``omni-worker --role encode|prefill|decode|generate --model DIR --broker ENDPOINT``: one worker daemon.

Reads the config (its flags are generated from :class:`WorkerConfig`'s fields, see
:mod:`omnirelay.config_flags`; a flag left out that defaults to None takes the stage YAML's value),
looks up the builder of this role for the model's kind in the role table
(:mod:`omnirelay.workers.role_table`; a role the kind has no builder for, or sizes its engine cannot
run on the model, exit with status 2 before anything loads), which loads the model and opens the
connector, engine and role adapter; then runs
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
from typing import Callable

import torch

from omnirelay.pipeline import (ConnectorSpec, PipelineError, default_llm_pipeline, load_pipeline,
                                       parse_pipeline)
from omnirelay.lifecycle import Shutdown, add_logging_arguments, setup_logging
from omnirelay import config_flags
from omnirelay.model_kind import model_kind
from omnirelay.security import CurveKeys, add_curve_arguments, keys_from_args, require_curve_off_loopback
from omnirelay.tracing import Tracing, add_tracing_arguments, tracing_from_args

from omnirelay.workers.generate.sequence_parallel_group import SequenceParallelGroupLost
from omnirelay.workers.role_table import check_config, role_builder
from omnirelay.workers.runtime.assembly import RoleBuilder, closed_on_error
from omnirelay.workers.llm.lora import LoraError
from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.runtime.devices import KVBudgetError, resolve_devices
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


def build_parser() -> argparse.ArgumentParser:
    """omni-worker's flags: those of :class:`WorkerConfig`'s fields, generated from them
    (:mod:`omnirelay.config_flags`), and those that set no field of it (the stage pipeline, the
    health endpoint, logging, CURVE keys, tracing)."""
    parser = argparse.ArgumentParser(prog="omni-worker", description="omnirelay worker daemon")
    config_flags.add_flags(parser, WorkerConfig)
    parser.add_argument("--stage-configs-path", default=None,
                        help="stage-pipeline YAML; its edge names this worker's connector")
    parser.add_argument("--connector", default="shared_memory", help="connector backend without a pipeline file")
    parser.add_argument("--connector-options", default="{}",
                        help="JSON map of backend options (with --stage-configs-path: added to the file's options "
                             "of this worker's connector, e.g. a per-host local_hostname)")
    parser.add_argument("--health-port", type=int, default=None,
                        help="serve GET /live and /ready on this port (0: any free one) for HTTP probes such as "
                             "Kubernetes' (workers/runtime/health_server.py; default: off)")
    parser.add_argument("--health-host", default="127.0.0.1", help="address of the health endpoint")
    add_logging_arguments(parser)
    add_curve_arguments(parser, server=False, client=True)
    add_tracing_arguments(parser)
    return parser


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The config from ``args`` (parsed by :func:`build_parser`): the flags given, else the stage
    YAML's values for the flags that default to it, else the fields' defaults; the connector comes
    from the stage pipeline. ``ValueError``, ``json.JSONDecodeError`` or ``PipelineError`` for bad
    flags or a bad pipeline file."""
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
    # A flag left out takes the stage's value where the stage has one.
    fallbacks = {"model_name": args.model, "capacity": stage.max_batch_size,
                 "stream_chunk_tokens": stage.stream_chunk_tokens, "kv_transfer": stage.kv_transfer,
                 "sequence_parallel_size": stage.sequence_parallel_size,
                 "expert_parallel": stage.enable_expert_parallel, "lora": stage.lora,
                 "quantization": stage.quantization,
                 "speculative": stage.speculative}
    return config_flags.from_args(WorkerConfig, args, fallbacks=fallbacks, connector=connector.type,
                                  connector_options=connector.options)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(f"omni-worker-{args.role}", args.log_level, args.log_format)
    # Several workers share the host's cores; one thread each keeps them from starving each other.
    torch.set_num_threads(args.threads)
    try:
        config = worker_config(args)
        build = role_builder(config.role, model_kind(config.model_path))   # before anything loads
        check_config(config)   # the chosen engine's checks of the sizes, on the model's metadata
        devices = _resolve_worker_devices(config)
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
