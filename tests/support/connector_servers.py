"""Real servers for the connector tests (not a test module): ``redis-server`` and
``mooncake_master``, each started on a free port of 127.0.0.1, waited on until it answers, and
stopped by the PID we started — never by name.

Every ``redis-server`` started here is checked for keys at its teardown (its last stop): whatever
is left there is recorded in :data:`LEFTOVER_REDIS_KEYS`, which the session's leak check in
``conftest.py`` reports. A key that carries a TTL still counts: a connector must delete what it
put, not leave it to expire (a test of TTL expiry waits until the keys are gone before it stops).

Also the long-lived **peer** process (``tests/support/connector_peer.py``) that plays the other side of a
transfer, driven by JSON lines over its stdin/stdout.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER = HERE / "connector_peer.py"
QUIET_MOONCAKE = {"GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}
# "redis-server :PORT (stopped by TEST)" → the keys it still held when it was stopped for the last time.
LEFTOVER_REDIS_KEYS: dict[str, list[str]] = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class ManagedProcess:
    """A child server process that we started and that we alone stop (by PID)."""

    def __init__(self, argv: list[str], log_path: Path, env: dict | None = None):
        self.argv, self.log_path, self.env = argv, log_path, env
        self.proc: subprocess.Popen | None = None

    def start(self, ready, timeout: float = 20.0) -> None:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(self.env or {})}, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"{self.argv[0]} exited with {self.proc.returncode}: {self.log_tail()}")
            if ready():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.argv[0]} not ready within {timeout}s: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        self.proc = None


class RedisServer(ManagedProcess):
    def __init__(self, workdir: Path, port: int | None = None):
        self.port = port or free_port()
        self.workdir = workdir
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install -y redis-server)")
        super().__init__([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--dir", str(workdir), "--protected-mode", "yes", "--loglevel", "warning"],
                         workdir / f"redis-{self.port}.log")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, db: int = 0):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port, db=db, socket_timeout=5)

    def start(self, timeout: float = 20.0) -> None:
        def ready() -> bool:
            try:
                return bool(self.client().ping())
            except Exception:  # noqa: BLE001 - not up yet
                return False
        # Started again: the last stop was an outage the test made on purpose, not its teardown;
        # without persistence the server comes back empty and what it held was lost by design.
        for label in [label for label in LEFTOVER_REDIS_KEYS if label.startswith(f"redis-server :{self.port} ")]:
            del LEFTOVER_REDIS_KEYS[label]
        super().start(ready, timeout)

    def keys(self) -> list[str]:
        """Every key in every database (a test server holds nothing but the tests' payloads)."""
        found = []
        for db in self.client().info("keyspace"):   # {"db0": {"keys": …}, …}: only databases that hold keys
            found += [f"{db}:{key.decode(errors='replace')}"
                      for key in self.client(int(db[2:])).scan_iter(count=1000)]
        return sorted(found)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.running:
            try:
                left = self.keys()
            except Exception as exc:  # noqa: BLE001 - a server that cannot answer cannot be checked
                left = [f"(could not list keys: {type(exc).__name__}: {exc})"]
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
            if left:
                LEFTOVER_REDIS_KEYS[f"redis-server :{self.port} (stopped by {test})"] = left
        super().stop(sig, timeout)


def mooncake_skip_reason(*modules: str) -> str | None:
    """Why the Mooncake backends cannot run here, or None: a module of ``modules`` (default: the
    transfer engine and the store) that does not import, or whose shared library does not load."""
    try:
        for module in modules or ("mooncake.engine", "mooncake.store"):
            importlib.import_module(module)
    except ImportError as exc:
        return f"mooncake unavailable: import failed: {exc} (pip install 'omnirelay[mooncake]'; Debian libibverbs1)"
    except OSError as exc:
        return f"mooncake unavailable: shared library failed to load: {exc} (Debian: apt-get install libibverbs1)"
    return None


def _started(make: "Callable[[], ManagedProcess]", unavailable: str) -> "ManagedProcess":
    """``make()`` started, or the test skipped: the binary is missing (raised by the constructor)
    or the server does not come up."""
    import pytest

    try:
        server = make()
        server.start()
    except (FileNotFoundError, RuntimeError) as exc:
        pytest.skip(f"{unavailable}: {exc}")
    return server


def started_redis(workdir: Path) -> "RedisServer":
    """A running ``redis-server`` for a test (the caller stops it), or the test skipped with the
    precise reason."""
    import pytest

    pytest.importorskip("redis", reason="redis backend unavailable: redis-py not installed "
                                        "(pip install 'omnirelay[redis]')")
    return _started(lambda: RedisServer(workdir), "redis backend unavailable")


def started_mooncake_master(workdir: Path) -> "MooncakeMaster":
    """A running ``mooncake_master`` (the caller stops it), or the test skipped with the reason."""
    import pytest

    reason = mooncake_skip_reason()
    if reason:
        pytest.skip(reason)
    return _started(lambda: MooncakeMaster(workdir), "mooncake_store unavailable: mooncake_master failed to start")


def mooncake_master_binary() -> str | None:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which("mooncake_master", path=path)


class MooncakeMaster(ManagedProcess):
    def __init__(self, workdir: Path):
        binary = mooncake_master_binary()
        if binary is None:
            raise FileNotFoundError("mooncake_master not found (pip install 'omnirelay[mooncake]')")
        self.port, metrics = free_port(), free_port()
        super().__init__([binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1", f"--metrics_port={metrics}",
                          "--metrics_host=127.0.0.1", "--rpc_thread_num=2", "--enable_metric_reporting=false"],
                         workdir / f"mooncake-master-{self.port}.log", env=QUIET_MOONCAKE)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        super().start(lambda: _port_open(self.port), timeout)


class Peer:
    """A connector in another process: ``call({"op": …})`` sends one command, returns its reply.
    Without a backend the peer starts empty; :meth:`open` gives it a connector (again and again)."""

    def __init__(self, backend: str | None = None, options: dict | None = None, *, env: dict | None = None):
        args = [backend, json.dumps(options or {})] if backend else []
        self.proc = subprocess.Popen([sys.executable, str(PEER), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **QUIET_MOONCAKE, **(env or {})})
        self.pid = self.proc.pid
        self._hello: dict | None = None

    def wait_ready(self, timeout: float = 60.0) -> dict:
        if self._hello is None:
            self._hello = self.read(timeout)
        return self._hello

    def open(self, backend: str, options: dict) -> None:
        """Replace the peer's connector (the previous one is closed)."""
        self.wait_ready()
        self.call({"op": "open", "backend": backend, "options": options})

    def close_connector(self) -> None:
        self.call({"op": "close"})

    def read(self, timeout: float = 60.0) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout):
                raise AssertionError(f"peer {self.pid} said nothing within {timeout}s")
            line = self.proc.stdout.readline()
        finally:
            sel.close()
        if not line:
            self.proc.wait(10)
            raise AssertionError(f"peer {self.pid} exited with {self.proc.returncode}: "
                                 f"{self.proc.stderr.read()[-3000:]}")
        reply = json.loads(line)
        if "crash" in reply:
            raise AssertionError(f"peer {self.pid} failed: {reply['crash']}")
        return reply

    def send(self, command: dict) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def call(self, command: dict, timeout: float = 60.0) -> dict:
        self.send(command)
        return self.read(timeout)

    def kill9(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(10)

    def close(self, timeout: float = 30.0) -> None:
        """Ask the peer to close its connector and exit; kill it (by PID) if it does not."""
        try:
            if self.proc.poll() is None:
                self.call({"op": "exit"}, timeout=timeout)
                self.proc.wait(timeout)
        except (AssertionError, OSError, subprocess.TimeoutExpired, ValueError):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                stream.close()
