"""``omni-worker --role prefill|decode|generate --model DIR --broker ENDPOINT``: one worker daemon.

Builds the worker's parts in order — config, model, connector, engine, role adapter, runtime — and
runs the runtime until SIGTERM/SIGINT, then drains. Ranks of a GPU group beyond rank 0 never talk
to the broker (tensor/pipeline parallelism is set up inside the engine).
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch

from omnirelay.connectors import create_connector
from omnirelay.deploy.pipeline import (ConnectorSpec, PipelineError, default_llm_pipeline, load_pipeline,
                                       parse_pipeline)
from omnirelay.lifecycle import Shutdown, add_logging_arguments, setup_logging
from omnirelay.security import CurveKeys, add_curve_arguments, keys_from_args, require_curve_off_loopback

from .config import WorkerConfig
from .decode import DecodeEngine
from .generate_role import build_generate_role
from .kv_cache import PagedKVCache
from .models.llama import LlamaModel
from .prefill import PrefillEngine
from .roles import DecodeRole, PrefillRole
from .runtime import WorkerRuntime

log = logging.getLogger("omnirelay.worker")


def build_runtime(config: WorkerConfig, shutdown: Shutdown | None = None,
                  keys: CurveKeys | None = None) -> WorkerRuntime:
    if config.role == "generate":   # a diffusers pipeline directory: no KV cache, no connector yet
        role, stats = build_generate_role(config)
        return WorkerRuntime(config, role, stats, shutdown, keys)
    dtype = getattr(torch, config.dtype)
    model = LlamaModel(config.model_path, dtype=dtype)
    max_model_len = config.max_model_len or model.config.max_position_embeddings
    if max_model_len > model.config.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                         f"max_position_embeddings {model.config.max_position_embeddings}")
    connector = create_connector(config.connector, config.connector_options)
    if config.role == "prefill":
        engine = PrefillEngine(model, connector, max_model_len=max_model_len)
        role = PrefillRole(config.worker_id, engine)

        def stats() -> dict:
            return {"running": 0, "waiting": engine.num_requests, **engine.stats,
                    **_connector_stats(connector)}
    else:
        cfg = model.config
        cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=config.block_size,
                             budget_bytes=config.kv_cache_bytes, dtype=dtype)
        engine = DecodeEngine(model, cache, connector, max_num_seqs=config.capacity, max_model_len=max_model_len)
        role = DecodeRole(config.worker_id, engine)

        def stats() -> dict:
            return {"running": len(engine.running), "waiting": len(engine.waiting),
                    "free_kv_blocks": cache.allocator.free, "kv_blocks_total": cache.num_blocks - 1,
                    **engine.stats, **_connector_stats(connector)}
    log.info("%s worker %s ready: model %s (%s), max_model_len %d", config.role, config.worker_id,
             config.model_path, config.dtype, max_model_len)
    return WorkerRuntime(config, role, stats, shutdown, keys, owned=(connector,))


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
    parser.add_argument("--kv-cache-bytes", type=int, default=WorkerConfig.kv_cache_bytes)
    parser.add_argument("--block-size", type=int, default=WorkerConfig.block_size)
    parser.add_argument("--stage-configs-path", default=None,
                        help="stage-pipeline YAML; its edge names this worker's connector")
    parser.add_argument("--connector", default="shared_memory", help="connector backend without a pipeline file")
    parser.add_argument("--connector-options", default="{}", help="JSON map of backend options")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--drain-timeout", type=float, default=WorkerConfig.drain_timeout_s)
    parser.add_argument("--heartbeat-interval", type=float, default=WorkerConfig.heartbeat_interval_s)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
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
            drain_timeout_s=args.drain_timeout, dtype=args.dtype)
        keys = keys_from_args(args)
        require_curve_off_loopback(keys, config.broker)
    except (ValueError, json.JSONDecodeError, PipelineError) as exc:   # SecurityError included
        parser.error(str(exc))
    shutdown = Shutdown().install()
    runtime = build_runtime(config, shutdown, keys)
    print(f"omni-worker {config.role} ready: {config.worker_id}", flush=True)
    runtime.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
