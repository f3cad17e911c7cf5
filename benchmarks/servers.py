"""Servers the benchmark scripts start for themselves (not a benchmark): ``redis-server`` and
``mooncake_master``, each on a free port of 127.0.0.1, waited on until it accepts connections, and
stopped by the PID we started — never by name. Used by ``connectors.py`` and ``kv_transfer.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


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
