"""Servers the benchmark scripts start for themselves (not a benchmark): ``redis-server`` and
``mooncake_master``, each on a free port of 127.0.0.1, waited on until it accepts connections, and
stopped by the PID we started — never by name (``connectors.py``, ``kv_transfer.py``); and an
OpenAI-compatible HTTP server (omni-serve, ``vllm serve``) in a process group of its own, ready once
``/v1/models`` lists the served name, stopped by that group's id (``serve_vs_vllm.py``,
``lora_serving.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


class HttpServer:
    """``cmd`` (a server listening on ``port`` of 127.0.0.1) in its own process group, its output in
    ``log_path``; :meth:`wait_ready` until ``/v1/models`` lists ``served``; :meth:`stop` the group."""

    def __init__(self, name: str, cmd: list[str], port: int, served: str, log_path: Path, env: dict | None = None,
                 cwd: str | None = None):
        self.name, self.port, self.served, self.cmd = name, port, served, cmd
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "w")
        print(f"[{time.strftime('%H:%M:%S')}] start {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env, stdin=subprocess.DEVNULL, cwd=cwd)

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until ready; stops the server and raises if it exits or is not ready in time."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self._log.name}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as reply:
                    if self.served in [m["id"] for m in json.load(reply)["data"]]:
                        return time.monotonic() - start
            except (urllib.error.URLError, OSError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f}s; see {self._log.name}")

    def private_memory(self) -> dict[str, int]:
        """Private_Dirty bytes of each process in the server's group, by command line (RSS would count
        the safetensors pages mapped from the page cache, which processes share)."""
        out: dict[str, int] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getpgid(int(entry.name)) != self.proc.pid:
                    continue
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                dirty = sum(int(line.split()[1]) for line in (entry / "smaps_rollup").read_text().splitlines()
                            if line.startswith("Private_Dirty:"))
            except (OSError, ProcessLookupError, ValueError):
                continue
            out[f"{entry.name} {cmd[:160]}"] = dirty * 1024
        return out

    def stop(self) -> None:
        """SIGTERM to the group we started, SIGKILL after 60 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if not self._log.closed:
            self._log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    """Return once ``port`` accepts a connection; stop ``proc`` and raise if it does not in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    stop(proc)
    raise RuntimeError(f"server on port {port} did not start")


def start_redis(workdir: str) -> tuple[subprocess.Popen, str] | None:
    """A fresh ``redis-server`` (no persistence) and its URL; None when none is installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir, "--loglevel", "warning"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    wait_port(port, proc)
    return proc, f"redis://127.0.0.1:{port}/0"


def start_mooncake_master() -> tuple[subprocess.Popen, str] | None:
    """A ``mooncake_master`` (looked up beside this interpreter first) and its address; None when
    none is installed."""
    binary = shutil.which("mooncake_master", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                                 os.environ.get("PATH", "")]))
    if binary is None:
        return None
    port = free_port()
    proc = subprocess.Popen([binary, f"--rpc_port={port}", "--rpc_address=127.0.0.1", f"--metrics_port={free_port()}",
                             "--metrics_host=127.0.0.1", "--rpc_thread_num=2", "--enable_metric_reporting=false"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "GLOG_minloglevel": "2"})
    wait_port(port, proc)
    return proc, f"127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 15 s; always reaps."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()
