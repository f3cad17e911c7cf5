"""``omni-serve [MODEL_DIR …]``: everything on one host — broker, gateway and the workers of every
stage of each model's pipeline (:mod:`omnirelay.deploy.served_models` picks it from the directory:
prefill → decode for a causal LM, one generate stage for a diffusers pipeline, encode → prefill →
decode → generate for Qwen2.5-Omni; ``--stage-configs-path`` overrides), ``--num-<role>`` of each.

Start-up: broker first (on a private ipc:// endpoint), then the workers and the gateway; ready when
the gateway's ``/health`` answers 200 (every role has a live worker), then it prints where it
listens. A child that exits during start-up, or a start-up longer than ``--stage-init-timeout``,
fails with a message naming that child.

Supervision: a child that dies is restarted (at most 5 times a minute, then omni-serve gives up).
Shutdown: SIGINT/SIGTERM stops all children in order —
gateway, workers (SIGTERM lets them drain), broker — each escalated to SIGKILL after a grace
period; then the shared-memory segments owned by the children are swept and the run directory is
removed. Children also get SIGKILL from the kernel if this launcher itself dies (PR_SET_PDEATHSIG),
so no process outlives it.

Parallelism flags: ``--tensor-parallel-size``, ``--pipeline-parallel-size``, ``--devices`` (one
worker's GPU group) and ``--gpu-memory-utilization`` are checked before anything starts
(:func:`check_parallel`): devices must number TP × PP (× SP: generate), TP must divide the model's attention and KV
heads, PP must not exceed its layers, a stage of the pipeline file that sets a size must agree with
the flag. ``--enable-expert-parallel`` (or a stage's ``engine_args.enable_expert_parallel``) makes
the prefill/decode ranks of an MoE model hold whole experts: the model's experts must divide by TP. They reach ``omni-worker`` once it runs GPU groups (:data:`WORKER_RUNS_GROUPS`) and takes
device lists (:data:`WORKER_TAKES_DEVICES`); until then any size but 1, or a device list, is refused
with a message saying so. Every worker of this host gets the same ``--devices`` (its GPU group) and
``--gpu-memory-utilization`` (the share of each device it may fill, counting memory already in use,
so workers sharing a group need shares that leave each other room); ``--kv-cache-bytes`` left at 0
lets the utilization size the KV pool on CUDA (256 MiB on the CPU), a value caps it
(:mod:`omnirelay.workers.runtime.devices`).

A ``yuanrong`` edge (``--connector yuanrong``, or a pipeline file's connector of that type without
an ``address``) needs this host's openYuanrong datasystem worker: ``--yuanrong-address HOST:PORT``
names a running one, else omni-serve starts a single-node one in its run directory before any other
child (:mod:`omnirelay.deploy.yuanrong_worker`: free ports, the ready file waited on), hands its
address to those workers as ``--connector-options``, and stops it after them. Without the
``yuanrong`` extra installed it refuses to start, saying so.

``--ray-address ADDR`` places the same daemons on a Ray cluster instead of this host (see
:mod:`omnirelay.deploy.ray_launcher`); ``--emit kubernetes DIR`` writes Kubernetes manifests for them
instead of starting anything (:mod:`omnirelay.deploy.kubernetes`).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import NamedTuple

from omnirelay import config_flags, lora_modules, speculative
from omnirelay.connectors.shared_memory import sweep_orphans
from omnirelay.pipeline import ConnectorSpec, PipelineError
from omnirelay.deploy.served_models import BUNDLED, ModelPlan, plan_models
from omnirelay.gateway.config import GatewayConfig, ServedModel
from omnirelay.lifecycle import Shutdown
from omnirelay.process_memory import private_bytes
from omnirelay.security import is_loopback
from omnirelay.tracing import add_tracing_arguments, tracing_argv
from omnirelay.workers.runtime.config import WorkerConfig

# Whether omni-worker accepts --tensor-parallel-size/--pipeline-parallel-size/--devices/
# --gpu-memory-utilization. Flip to True once `omni-worker --help` lists them.
WORKER_RUNS_GROUPS = True
# omni-worker places rank i of a prefill/decode group on the i-th listed device (NCCL between them)
# and sizes its KV pool from --gpu-memory-utilization; without --devices it picks cuda:0..N-1, or the
# CPU on a host without CUDA (omnirelay.workers.runtime.devices).
WORKER_TAKES_DEVICES = True

_PR_SET_PDEATHSIG = 1
# The gateway only reads a pipeline's roles: any prefill → decode file stands for a causal LM's.
LLM_PIPELINE = str(BUNDLED / "llm.yaml")


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Child:
    def __init__(self, name: str, argv: list[str], log_args: list[str]):
        self.name = name
        self.argv = [sys.executable, "-m", *argv, *log_args]
        self.restarts: list[float] = []   # monotonic times of recent restarts
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(self.argv, preexec_fn=_die_with_parent, stdin=subprocess.DEVNULL)

    def restart(self, now: float, window_s: float, limit: int) -> bool:
        """Start the process again unless it already restarted ``limit`` times in ``window_s``."""
        self.restarts = [t for t in self.restarts if now - t < window_s]
        if len(self.restarts) >= limit:
            return False
        self.restarts.append(now)
        self.proc = self._spawn()
        return True

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# omni-serve asks its own gateway, a child on this host: never through an http_proxy the
# environment names (with no no_proxy for it, the readiness check would never pass).
_OWN_GATEWAY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _health(url: str) -> bool:
    try:
        with _OWN_GATEWAY.open(url + "/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _read_ready_file(path: str) -> str | None:
    try:
        with open(path) as handle:
            text = handle.read().strip()
        return text or None
    except FileNotFoundError:
        return None


# GatewayConfig and ServedModel fields whose flags omni-serve declares from the config and hands to
# omni-gateway unchanged. Not these: --served-model-name and --broker, which mean something else here
# (names of positional MODELs; the endpoint the broker binds, default a private socket), and
# --max-model-len, which the workers get too (declared from WorkerConfig's field).
PASSED_TO_GATEWAY = ("host", "port", "api_key", "disable_log_requests", "protect_probes",
                     "allow_special_tokens_in_content", "trust_request_chat_template",
                     "request_timeout_s", "worker_wait_s", "video_timeout_s", "video_stall_timeout_s", "max_body_bytes",
                     "max_streams_per_client", "stream_write_timeout_s", "header_timeout_s", "read_timeout_s",
                     "max_image_pixels", "min_audio_sample_rate", "max_audio_sample_rate",
                     "enable_force_include_usage", "enable_prompt_tokens_details", "enable_server_load_tracking")
PASSED_TO_GATEWAY_PER_MODEL = ("allowed_local_media_path", "reasoning_parser", "tool_call_parser",
                               "default_chat_template_kwargs", "scheduling_policy", "structured_outputs_in_reasoning",
                               "pooler_config")


# WorkerConfig fields whose flags omni-serve declares from the config and hands to every worker unchanged.
PASSED_TO_WORKERS = ("max_model_len", "kv_cache_bytes", "dtype", "devices", "gpu_memory_utilization", "quantization")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-serve", description="serve a model with every role on this host")
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help="local model directories, each with its own workers behind one gateway "
                             "(default: the embedded models, one per modality, built once and cached; "
                             "see omnirelay.deploy.embedded)")
    parser.add_argument("--served-model-name", action="append", default=None,
                        help="model id clients use, one per MODEL in order (default: the path as given)")
    parser.add_argument("--num-prefill", type=int, default=1, help="prefill workers per model")
    parser.add_argument("--num-decode", type=int, default=1, help="decode workers per model")
    parser.add_argument("--num-encode", type=int, default=1, help="encode workers per model that has an encode stage")
    parser.add_argument("--num-generate", type=int, default=1,
                        help="generate workers per model that has a generate stage")
    parser.add_argument("--tensor-parallel-size", type=int, default=None,
                        help="ranks per worker that split heads and MLP columns (default 1, or the stage's)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=None,
                        help="ranks per worker that split the layers (default 1, or the stage's)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="MoE models: prefill/decode tensor ranks hold whole experts and exchange tokens "
                             "by all-to-all (the experts must divide by --tensor-parallel-size)")
    # Flags every worker gets as they are: generated from WorkerConfig's fields (their defaults and help),
    # so omni-serve and omni-worker cannot disagree on them (omnirelay/config_flags.py).
    config_flags.add_flags(parser.add_argument_group("worker flags (handed on to the workers)"),
                           WorkerConfig, only=PASSED_TO_WORKERS)
    config_flags.add_flags(parser.add_argument_group("decode worker flags (handed on to the decode workers)"),
                           WorkerConfig, only=("speculative",))
    parser.add_argument("--connector", default="shared_memory",
                        help="KV connector backend when no --stage-configs-path is given")
    parser.add_argument("--yuanrong-address", default=None, metavar="HOST:PORT",
                        help="the datasystem worker of this host for yuanrong edges (default: omni-serve starts "
                             "a single-node one on free ports and stops it on exit; omnirelay.deploy.yuanrong_worker)")
    parser.add_argument("--stage-configs-path", action="append", default=None,
                        help="stage-pipeline YAML (stages, connectors, edges): one for every model or one per "
                             "model in order (default: the bundled pipeline of each model's kind)")
    parser.add_argument("--stage-init-timeout", type=float, default=300.0)
    parser.add_argument("--drain-timeout", type=float, default=5.0)
    parser.add_argument("--autoscale", action="append", default=None, metavar="ROLE=MIN:MAX",
                        help="add and drain extra workers of ROLE (MIN to MAX beyond --num-ROLE) from the "
                             "broker's queues and the gateway's latency (omnirelay.fleet; repeat per role)")
    parser.add_argument("--broker", default=None,
                        help="endpoint the broker binds, so workers on other hosts can join (default: a "
                             "private ipc:// socket); off loopback it needs --curve-keys")
    # Flags the gateway gets as they are: generated from GatewayConfig's and ServedModel's fields (their
    # defaults, choices and help), so omni-serve and omni-gateway cannot disagree on them.
    config_flags.add_flags(parser.add_argument_group("gateway flags (passed to omni-gateway as they are)"),
                           GatewayConfig, only=PASSED_TO_GATEWAY)
    config_flags.add_flags(parser.add_argument_group("chat (passed to omni-gateway as they are)"),
                           ServedModel, only=PASSED_TO_GATEWAY_PER_MODEL)
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--log-format", choices=["text", "json"], default="text")
    ray = parser.add_argument_group("Ray placement (pip install 'omnirelay[ray]')")
    ray.add_argument("--ray-address", default=None,
                     help="place the daemons on this existing Ray cluster (host:port of its head) "
                          "instead of this host")
    ray.add_argument("--ray-worker-cpus", type=float, default=1.0, help="CPUs each worker actor reserves")
    ray.add_argument("--curve-keys", default=None,
                     help="omni-keygen directory with broker, gateway and worker keys; required when the "
                          "Ray head or --broker is not on loopback")
    add_tracing_arguments(parser)   # handed on to every daemon (omnirelay/tracing.py)
    lora_modules.add_arguments(parser, gateway=True)   # passed to the gateway and the prefill/decode workers
    from omnirelay.deploy.kubernetes import add_arguments as add_kubernetes_arguments
    add_kubernetes_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)   # models may come before or after the options
    try:
        lora_modules.options_from_args(args)
        speculative.parse(args.speculative_config or "")   # refused here, by name, before anything starts
    except ValueError as exc:
        parser.error(str(exc))

    if args.emit:   # manifests for a cluster instead of serving here (omnirelay.deploy.kubernetes)
        return _emit(parser, args)
    names = args.served_model_name or []
    if not args.models:
        if names:
            parser.error("--served-model-name needs MODEL directories; the embedded default names its own")
        from omnirelay.deploy.embedded import embedded_models
        models = embedded_models()
    else:
        if len(names) > len(args.models):
            parser.error("more --served-model-name than models")
        models = [(path, names[i] if i < len(names) else path) for i, path in enumerate(args.models)]
        for path, _ in models:
            if not os.path.isdir(path):
                parser.error(f"model directory {path!r} does not exist")

    try:
        plans = plan_models(models, args.stage_configs_path, args.connector)
        plans = [dataclasses.replace(plan, groups=check_parallel(args, plan)) for plan in plans]
    except (PipelineError, LaunchError) as exc:
        parser.error(str(exc))
    if min(args.num_prefill, args.num_decode, args.num_encode, args.num_generate) < 1:
        parser.error("--num-prefill, --num-decode, --num-encode and --num-generate must be at least 1")
    if args.broker and not is_loopback(args.broker) and not args.curve_keys:
        parser.error(f"--broker {args.broker} is not loopback: give --curve-keys (see omni-keygen)")
    needs_store = yuanrong_needs_address(args, plans)
    if needs_store and not args.yuanrong_address and args.ray_address:
        parser.error("a yuanrong edge on a Ray cluster needs --yuanrong-address (the datasystem worker of "
                     "the cluster's hosts); omni-serve starts one only on this host")
    if not args.ray_address and any(_connector_of(plan, role, args.connector).type == "yuanrong"
                                    for plan in plans for role in plan.roles):
        from omnirelay.deploy.yuanrong_worker import YuanrongUnavailable, worker_binary
        try:   # the workers of this host import its client: say so here, not in a worker's traceback
            worker_binary()
        except YuanrongUnavailable as exc:
            parser.error(str(exc))
    if args.ray_address:
        from omnirelay.deploy.ray_launcher import serve_on_ray
        return serve_on_ray(args, plans)
    shutdown = Shutdown().install()
    sweep_orphans()   # segments a previous, killed run left behind (their owners are dead)
    run_dir = tempfile.mkdtemp(prefix="omnirelay-serve-")
    store = None
    broker = args.broker or f"ipc://{run_dir}/broker.sock"
    ready_file = os.path.join(run_dir, "gateway.url")
    children: list[Child] = []
    log_args = ["--log-level", args.log_level, "--log-format", args.log_format, *tracing_argv(args)]
    curve = _local_curve_args(args.curve_keys)
    exit_code = 0
    try:
        if needs_store and not args.yuanrong_address:
            from omnirelay.deploy.yuanrong_worker import LocalYuanrongWorker, YuanrongUnavailable
            store = LocalYuanrongWorker(os.path.join(run_dir, "yuanrong"), die_with_parent=True)
            try:
                store.start()
            except YuanrongUnavailable as exc:
                print(f"omni-serve: {exc}", file=sys.stderr, flush=True)
                return 1
            args.yuanrong_address = store.address   # every worker command (the autoscaler's too) passes it on
        children.append(Child("broker", ["omnirelay.broker.daemon", "--endpoint", broker, *curve["broker"],
                                         "--scheduling-policy", args.scheduling_policy],
                              log_args))
        for command in worker_commands(args, plans, broker):
            children.append(Child(command.name, [*command.argv, *curve["worker"]], log_args))
        children.append(Child("gateway", [*gateway_command(args, plans, broker, ready_file),
                                          *curve["gateway"]], log_args))

        url = _wait_ready(children, ready_file, args.stage_init_timeout, shutdown)
        if url is None:
            exit_code = 1 if not shutdown.requested else 0
        else:
            served = ", ".join(f"{plan.name!r} ({plan.path})" for plan in plans)
            print(f"omni-serve ready: {url} (models {served}); {_private_memory_line(children)}", flush=True)
            scaler = None
            if args.autoscale:
                from omnirelay.fleet.serve_hook import start as start_autoscaler
                scaler = start_autoscaler(args, plans, broker, url)
            try:
                exit_code = _supervise(children, shutdown)
            finally:
                if scaler is not None:
                    scaler.close()   # drains the extra workers before the fixed fleet stops
    finally:
        _stop_all(children, args.drain_timeout)
        if store is not None:   # after the workers: they delete what they still hold on the way out
            store.stop()
        sweep_orphans()   # every child is gone now: this takes all of their segments
        shutil.rmtree(run_dir, ignore_errors=True)
    return exit_code


def _emit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from omnirelay.deploy.kubernetes import EmitError, emit
    if min(args.num_prefill, args.num_decode, args.num_encode, args.num_generate) < 1:
        parser.error("--num-prefill, --num-decode, --num-encode and --num-generate must be at least 1")
    for path in args.models:
        if not os.path.isdir(path):
            parser.error(f"model directory {path!r} does not exist")
    try:
        written = emit(args, check_parallel)
    except (EmitError, PipelineError, LaunchError) as exc:
        parser.error(str(exc))
    print(f"omni-serve: wrote {len(written)} manifest files to {args.emit[1]} (kubectl apply -f {args.emit[1]}; "
          "docs/KUBERNETES.md)", flush=True)
    return 0


def _local_curve_args(keys_dir: str | None) -> dict[str, list[str]]:
    """CURVE flags per daemon from an ``omni-keygen DIR broker gateway worker`` directory."""
    if not keys_dir:
        return {"broker": [], "worker": [], "gateway": []}
    key = lambda name: os.path.join(os.path.abspath(keys_dir), name)  # noqa: E731
    return {
        "broker": ["--curve-secret-key", key("broker.key_secret"), "--curve-authorized-keys", key("authorized")],
        "worker": ["--curve-secret-key", key("worker.key_secret"), "--curve-server-key", key("broker.key")],
        "gateway": ["--curve-secret-key", key("gateway.key_secret"), "--curve-server-key", key("broker.key"),
                    "--curve-authorized-keys", key("authorized")],
    }


class LaunchError(ValueError):
    """Launcher settings that contradict each other or the model; the message names the flag."""


def _device_ids(text: str) -> list[str]:
    ids = [item.strip() for item in text.split(",") if item.strip()]
    if not ids or not all(item.isdigit() for item in ids) or len(set(ids)) != len(ids):
        raise LaunchError(f"--devices {text!r}: expected distinct device ids like 0,1")
    return ids


def _model_shape(model_dir: str) -> dict | None:
    """Heads and layers from an HF config.json; None for a directory without one (diffusers)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int):
        return None
    return {"heads": heads, "kv_heads": config.get("num_key_value_heads") or heads,
            "layers": config.get("num_hidden_layers") or 0,
            "experts": config.get("num_experts") or config.get("num_local_experts") or 0}


def check_parallel(args: argparse.Namespace, plan: ModelPlan) -> dict[str, tuple[int, int]]:
    """Validate the parallelism settings for one model; returns role → (tensor, pipeline) parallel
    size. Raises :class:`LaunchError` naming the offending flag or stage."""
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise LaunchError(f"--gpu-memory-utilization {args.gpu_memory_utilization}: must be in (0, 1]")
    for flag, value in (("--tensor-parallel-size", args.tensor_parallel_size),
                        ("--pipeline-parallel-size", args.pipeline_parallel_size)):
        if value is not None and value < 1:
            raise LaunchError(f"{flag} {value}: must be at least 1")
    shape = _model_shape(plan.path)
    groups: dict[str, tuple[int, int]] = {}
    for role in plan.roles:
        stage = plan.pipeline.stage_for_role(role)
        sizes = []
        for flag, key, value in (("--tensor-parallel-size", "tensor_parallel_size", args.tensor_parallel_size),
                                 ("--pipeline-parallel-size", "pipeline_parallel_size", args.pipeline_parallel_size)):
            stage_value = stage.engine_args.get(key) if plan.pipeline_file else None
            if stage_value is not None and value is not None and stage_value != value:
                raise LaunchError(f"{flag} {value} contradicts stage {stage.name!r} of --stage-configs-path "
                                  f"{plan.pipeline_file}, "
                                  f"which sets {key}: {stage_value}")
            sizes.append(value or stage_value or 1)
        tp, pp = sizes
        groups[role] = (tp, pp)
        if args.devices is not None:
            devices = _device_ids(args.devices)
            # A generate stage's group also has its sequence-parallel ranks (as worker_commands counts
            # it); that size comes from the stage config only, so the message names the stage.
            sp = stage.sequence_parallel_size
            if len(devices) != tp * pp * sp:
                raise LaunchError(f"--devices {args.devices} names {len(devices)} device(s) but the {role} worker's "
                                  f"group is --tensor-parallel-size {tp} × --pipeline-parallel-size {pp} × "
                                  f"sequence_parallel_size {sp} (stage {stage.name!r}) = {tp * pp * sp}")
            if sp > 1:   # fail here, not as a worker that exits 2 after the launch
                raise LaunchError(f"--devices: stage {stage.name!r} runs sequence_parallel_size {sp}, whose ranks "
                                  "run on the CPU over gloo in this build; leave --devices out")
        if shape is None or role not in ("prefill", "decode"):
            continue
        if shape["heads"] % tp or shape["kv_heads"] % tp:
            raise LaunchError(f"--tensor-parallel-size {tp} does not divide the {shape['heads']} attention heads "
                              f"and {shape['kv_heads']} KV heads of {plan.path} (its config.json)")
        if shape["layers"] and pp > shape["layers"]:
            raise LaunchError(f"--pipeline-parallel-size {pp} exceeds the {shape['layers']} layers of {plan.path}")
        if args.enable_expert_parallel or (plan.pipeline_file and stage.enable_expert_parallel):
            if not shape["experts"]:
                raise LaunchError(f"--enable-expert-parallel: {plan.path} is not a mixture-of-experts model")
            if shape["experts"] % tp:
                raise LaunchError(f"--enable-expert-parallel: the {shape['experts']} experts of {plan.path} do not "
                                  f"divide over the {role} worker's --tensor-parallel-size {tp} ranks (each rank "
                                  "owns a contiguous block of experts)")
    if not WORKER_RUNS_GROUPS:
        too_big = {role: size for role, size in groups.items() if size != (1, 1)}
        if too_big:
            role, (tp, pp) = next(iter(too_big.items()))
            raise LaunchError(f"the {role} worker would need tensor_parallel_size {tp} × pipeline_parallel_size {pp}, "
                              "but omni-worker in this build runs single-process workers: tensor and pipeline "
                              "parallelism are not wired into it yet; use 1")
    if not WORKER_TAKES_DEVICES:
        if args.devices is not None:
            raise LaunchError("--devices: omni-worker in this build does not take a device list yet; "
                              "leave it out (Ray sets CUDA_VISIBLE_DEVICES under --ray-address)")
    return groups


class WorkerCommand(NamedTuple):
    name: str          # e.g. "decode-0.1": role, model number, index
    role: str
    argv: list[str]    # after ``python -m``
    group_size: int    # ranks (devices) of its group: tensor × pipeline (× sequence) parallel size


def worker_commands(args: argparse.Namespace, plans: list[ModelPlan], broker: str) -> list[WorkerCommand]:
    """Every worker to start: ``--num-<role>`` workers per role of each model."""
    counts = {"prefill": args.num_prefill, "decode": args.num_decode,
              "encode": args.num_encode, "generate": args.num_generate}
    commands = []
    utilization = args.gpu_memory_utilization
    if not args.ray_address:
        # On one host every worker sees the same devices: they split the share evenly, each
        # sizing its KV pool from its own part (Ray gives each actor devices of its own).
        utilization /= sum(counts.get(role, 1) for plan in plans for role in plan.roles)
    for model_number, plan in enumerate(plans):
        for role in plan.roles:
            tp, pp = plan.groups.get(role, (1, 1))
            # A generate stage's sequence-parallel size (pipeline file only; the worker checks it
            # against the model at start-up and exits with the reason if it cannot run it).
            sp = plan.pipeline.stage_for_role(role).sequence_parallel_size
            parallel = []
            if WORKER_RUNS_GROUPS:
                parallel = ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
                            *(["--sequence-parallel-size", str(sp)] if sp > 1 else []),
                            *(["--enable-expert-parallel"] if args.enable_expert_parallel
                              and role in ("prefill", "decode") else [])]
            if WORKER_TAKES_DEVICES:
                parallel += ["--gpu-memory-utilization", f"{utilization:.4g}",
                             *(["--devices", args.devices] if args.devices and not args.ray_address else [])]
            store = (["--connector-options", json.dumps({"address": args.yuanrong_address})]
                     if args.yuanrong_address and _connector_of(plan, role, args.connector).type == "yuanrong"
                     and "address" not in _connector_of(plan, role, args.connector).options else [])
            for index in range(counts.get(role, 1)):
                commands.append(WorkerCommand(f"{role}-{model_number}.{index}", role, [
                    "omnirelay.workers.daemon", "--role", role, "--model", plan.path,
                    "--served-model-name", plan.name, "--broker", broker,
                    "--max-model-len", str(args.max_model_len), "--kv-cache-bytes", str(args.kv_cache_bytes),
                    "--dtype", args.dtype, "--connector", args.connector, *plan.pipeline_args(), *store, *parallel,
                    "--drain-timeout", str(args.drain_timeout),
                    *(["--speculative-config", args.speculative_config]
                      if args.speculative_config and role == "decode" else []),
                    *(lora_modules.to_args(lora_modules.options_from_args(args))
                      if role in ("prefill", "decode") else []),
                    *(["--quantization", args.quantization] if args.quantization and role in ("prefill", "decode")
                      else [])], tp * pp * sp))
    return commands


def _connector_of(plan: ModelPlan, role: str, connector: str) -> ConnectorSpec:
    """The connector a worker of ``role`` will open (as ``omni-worker`` decides): its stage's edge,
    or ``--connector`` for a generate stage without one."""
    stage = plan.pipeline.stage_for_role(role)
    if not any(stage.name in (edge.source, edge.target) for edge in plan.pipeline.edges):
        return ConnectorSpec("none", connector, {})
    return plan.pipeline.connector_for(role)


def yuanrong_needs_address(args: argparse.Namespace, plans: list[ModelPlan]) -> bool:
    """Whether some worker opens a ``yuanrong`` connector whose options name no ``address``: it
    then takes ``--yuanrong-address``, or the datasystem worker omni-serve starts."""
    return any(spec.type == "yuanrong" and "address" not in spec.options
               for plan in plans for spec in (_connector_of(plan, role, args.connector) for role in plan.roles))


def gateway_command(args: argparse.Namespace, plans: list[ModelPlan], broker: str,
                    ready_file: str, reply_host: str | None = None) -> list[str]:
    model_args = [arg for plan in plans for arg in ("--model", plan.path, "--served-model-name", plan.name)]
    # One pipeline file per model, in --model order; a causal LM without one gets the default.
    pipeline_files = [plan.pipeline_file for plan in plans]
    pipeline_args = ([] if not any(pipeline_files) else
                     [arg for plan in plans for arg in ("--stage-configs-path", plan.pipeline_file or LLM_PIPELINE)])
    return ["omnirelay.gateway.daemon", *model_args, "--broker", broker,
            "--max-model-len", str(args.max_model_len), "--ready-file", ready_file, *pipeline_args,
            *(["--reply-host", reply_host] if reply_host else []),
            *_passed_on(args, GatewayConfig, PASSED_TO_GATEWAY),
            *_passed_on(args, ServedModel, PASSED_TO_GATEWAY_PER_MODEL),
            *lora_modules.to_args(lora_modules.options_from_args(args), gateway=True)]


def _passed_on(args: argparse.Namespace, cls: type, fields: tuple[str, ...]) -> list[str]:
    """The command line that gives ``fields``' flags (of the config ``cls``) the values in ``args``:
    a repeatable flag once per value, a switch when on, any other flag unless its value is None or ""
    (left out, the daemon takes its own default)."""
    argv: list[str] = []
    specs = config_flags.flags(cls)
    for name in fields:
        spec = specs[name]
        value = getattr(args, spec.dest)
        if spec.options.get("action") == "append":
            argv += [arg for item in value or () for arg in (spec.name, item)]
        elif spec.options.get("action") == "store_true":
            argv += [spec.name] if value else []
        elif value is not None and value != "":
            argv += [spec.name, str(value)]
    return argv


RESTART_WINDOW_S, RESTART_LIMIT = 60.0, 5


def _supervise(children: list[Child], shutdown: Shutdown) -> int:
    """Restart a child that dies (the broker and gateway are stateless for the rest: workers
    re-register and gateways resume their streams); give up if one keeps dying."""
    while not shutdown.requested:
        for child in children:
            if child.alive():
                continue
            code = child.proc.returncode
            if not child.restart(time.monotonic(), RESTART_WINDOW_S, RESTART_LIMIT):
                print(f"omni-serve: {child.name} exited with code {code} {RESTART_LIMIT} times within "
                      f"{RESTART_WINDOW_S:.0f}s; stopping", file=sys.stderr, flush=True)
                return 1
            print(f"omni-serve: {child.name} exited with code {code}; restarted as pid {child.pid}",
                  file=sys.stderr, flush=True)
        shutdown.event.wait(0.5)
    return 0


def _private_memory_line(children: list[Child]) -> str:
    """Each process's unshared memory (Private_Dirty; omnirelay/process_memory.py) and their sum: what
    this host pays per role, the checkpoint's mapped pages (shared by the roles) not included."""
    sizes = [(c.name, private_bytes(c.pid)) for c in children]
    known = [(name, size) for name, size in sizes if size is not None]
    if not known:
        return "private memory: unknown"
    each = ", ".join(f"{name} {size / 2**30:.2f}" for name, size in known)
    return f"private memory GiB: {each}; total {sum(s for _, s in known) / 2**30:.2f}"


def _wait_ready(children: list[Child], ready_file: str, timeout_s: float, shutdown: Shutdown) -> str | None:
    deadline = time.monotonic() + timeout_s
    url = None
    while time.monotonic() < deadline and not shutdown.requested:
        dead = [c for c in children if not c.alive()]
        if dead:
            print(f"omni-serve: {dead[0].name} exited during start-up with code {dead[0].proc.returncode}",
                  file=sys.stderr, flush=True)
            return None
        url = url or _read_ready_file(ready_file)
        if url and _health(url):
            return url
        shutdown.event.wait(0.2)
    if not shutdown.requested:
        waiting = "the gateway to listen" if url is None else _health_message(url)
        print(f"omni-serve: not ready after {timeout_s:.0f}s (--stage-init-timeout): {waiting}",
              file=sys.stderr, flush=True)
    return None


def _health_message(url: str) -> str:
    """What /health says is missing (it names the model and the roles without a live worker)."""
    try:
        with _OWN_GATEWAY.open(url + "/health", timeout=2) as response:
            return response.read().decode()[:500]
    except urllib.error.HTTPError as exc:
        try:
            return json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return f"/health answered {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return f"/health unreachable: {exc}"


def _stop_all(children: list[Child], drain_s: float) -> None:
    order = ([c for c in children if c.name == "gateway"]
             + [c for c in children if c.name not in ("gateway", "broker")]
             + [c for c in children if c.name == "broker"])
    for child in order:
        if child.alive():
            child.proc.send_signal(signal.SIGTERM)
    for child in order:
        child.stop(drain_s + 5.0)


if __name__ == "__main__":
    raise SystemExit(main())
