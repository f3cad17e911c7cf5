"""``omni-serve [MODEL_DIR]``: everything on one host — broker, gateway, prefill and decode workers.

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
"""

from __future__ import annotations

import argparse
import ctypes
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

from omnirelay.connectors.shared_memory import sweep_orphans
from omnirelay.deploy.pipeline import PipelineError, load_pipeline
from omnirelay.lifecycle import Shutdown

_PR_SET_PDEATHSIG = 1


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


def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-serve", description="serve a model with every role on this host")
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help="local model directories, each with its own workers behind one gateway "
                             "(default: the tiny built-in model, built once and cached)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--served-model-name", action="append", default=None,
                        help="model id clients use, one per MODEL in order (default: the path as given)")
    parser.add_argument("--max-model-len", type=int, default=0)
    parser.add_argument("--kv-cache-bytes", type=int, default=256 * 1024 * 1024)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prefill", type=int, default=1)
    parser.add_argument("--num-decode", type=int, default=1)
    parser.add_argument("--connector", default="shared_memory",
                        help="KV connector backend when no --stage-configs-path is given")
    parser.add_argument("--stage-configs-path", default=None, help="stage-pipeline YAML (stages, connectors, edges)")
    parser.add_argument("--stage-init-timeout", type=float, default=300.0)
    parser.add_argument("--drain-timeout", type=float, default=5.0)
    parser.add_argument("--api-key", default=None, help="bearer token the gateway requires on /v1 routes")
    parser.add_argument("--disable-log-requests", action="store_true")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--log-format", choices=["text", "json"], default="text")
    args = parser.parse_intermixed_args(argv)   # models may come before or after the options

    names = args.served_model_name or []
    if not args.models:
        from .model_builder import default_model_dir
        models = [(str(default_model_dir()), names[0] if names else "tiny-llm")]
    else:
        if len(names) > len(args.models):
            parser.error("more --served-model-name than models")
        models = [(path, names[i] if i < len(names) else path) for i, path in enumerate(args.models)]
        for path, _ in models:
            if not os.path.isdir(path):
                parser.error(f"model directory {path!r} does not exist")

    try:
        pipeline = load_pipeline(args.stage_configs_path) if args.stage_configs_path else None
    except PipelineError as exc:
        parser.error(str(exc))
    pipeline_args = ["--stage-configs-path", os.path.abspath(args.stage_configs_path)] if pipeline else []
    roles = pipeline.roles if pipeline else ("prefill", "decode")
    shutdown = Shutdown().install()
    sweep_orphans()   # segments a previous, killed run left behind (their owners are dead)
    run_dir = tempfile.mkdtemp(prefix="omnirelay-serve-")
    broker = f"ipc://{run_dir}/broker.sock"
    ready_file = os.path.join(run_dir, "gateway.url")
    children: list[Child] = []
    log_args = ["--log-level", args.log_level, "--log-format", args.log_format]
    exit_code = 0
    try:
        children.append(Child("broker", ["omnirelay.broker.daemon", "--endpoint", broker], log_args))
        counts = {"prefill": args.num_prefill, "decode": args.num_decode}
        for model_number, (model_dir, served_name) in enumerate(models):
            for role in roles:
                for index in range(counts.get(role, 1)):
                    children.append(Child(f"{role}-{model_number}.{index}", [
                        "omnirelay.workers.daemon", "--role", role, "--model", model_dir,
                        "--served-model-name", served_name, "--broker", broker,
                        "--max-model-len", str(args.max_model_len), "--kv-cache-bytes", str(args.kv_cache_bytes),
                        "--dtype", args.dtype, "--connector", args.connector, *pipeline_args,
                        "--drain-timeout", str(args.drain_timeout)], log_args))
        model_args = [arg for path, name in models for arg in ("--model", path, "--served-model-name", name)]
        children.append(Child("gateway", [
            "omnirelay.gateway.daemon", *model_args, "--broker", broker, "--host", args.host,
            "--port", str(args.port), "--max-model-len", str(args.max_model_len),
            "--ready-file", ready_file, *pipeline_args,
            *(["--api-key", args.api_key] if args.api_key else []),
            *(["--disable-log-requests"] if args.disable_log_requests else [])], log_args))

        url = _wait_ready(children, ready_file, args.stage_init_timeout, shutdown)
        if url is None:
            exit_code = 1 if not shutdown.requested else 0
        else:
            served = ", ".join(f"{name!r} ({path})" for path, name in models)
            print(f"omni-serve ready: {url} (models {served})", flush=True)
            exit_code = _supervise(children, shutdown)
    finally:
        _stop_all(children, args.drain_timeout)
        sweep_orphans()   # every child is gone now: this takes all of their segments
        shutil.rmtree(run_dir, ignore_errors=True)
    return exit_code


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
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
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
