"""A single-node openYuanrong ``datasystem_worker`` on 127.0.0.1, for ``omni-serve --connector
yuanrong`` and the tests: the ``yuanrong`` connector's store when no ``--yuanrong-address`` is given.

The worker runs its own metastore (``--start_metastore_service``), so no etcd is needed. It gets two
free ports (its own and the metastore's) and a private directory that holds everything it writes
(unix sockets, logs, the metastore's rocksdb, the ready file; its shared memory is anonymous and
dies with it), instead of its defaults under ``~/datasystem``. Start-up deletes a stale ready file,
starts the binary in its own process group and waits (bounded) until the worker writes the ready
file — about 6 s, mostly an internal wait. :meth:`LocalYuanrongWorker.stop` sends SIGTERM to that
process group, SIGKILL after a grace period, and removes the directory. ``die_with_parent`` adds
PR_SET_PDEATHSIG, so a launcher that is killed takes the worker with it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1
READY_TIMEOUT_S = 60.0


class YuanrongUnavailable(RuntimeError):
    """The datasystem package is not installed, or its worker did not come up."""


def worker_binary() -> Path:
    """The ``datasystem_worker`` that ``openyuanrong-datasystem`` ships (its libraries beside it)."""
    try:
        import yr.datasystem
    except ImportError:
        raise YuanrongUnavailable("the yuanrong connector needs the 'yuanrong' extra: "
                                  "pip install 'omnirelay[yuanrong]' (openyuanrong-datasystem)") from None
    binary = Path(yr.datasystem.__file__).resolve().parent / "datasystem_worker"
    if not binary.is_file():
        raise YuanrongUnavailable(f"{binary} is missing from the openyuanrong-datasystem package")
    return binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_parent_death_signal() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class LocalYuanrongWorker:
    """One ``datasystem_worker`` we started and alone stop (by its process group)."""

    def __init__(self, directory: str | None = None, *, shared_memory_mb: int = 1024, die_with_parent: bool = False):
        self.binary = worker_binary()
        self.directory = Path(directory or tempfile.mkdtemp(prefix="omnirelay-yuanrong-"))
        self.port, self.metastore_port = _free_port(), _free_port()
        self.shared_memory_mb = shared_memory_mb
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ready_file(self) -> Path:
        return self.directory / "ready"

    @property
    def log_path(self) -> Path:
        return self.directory / "worker.out"

    def argv(self) -> list[str]:
        d = self.directory
        return [str(self.binary), f"-worker_address={self.address}",
                f"-metastore_address=127.0.0.1:{self.metastore_port}", "-start_metastore_service=true",
                f"-shared_memory_size_mb={self.shared_memory_mb}", f"-unix_domain_socket_dir={d / 'uds'}",
                f"-log_dir={d / 'logs'}", f"-ready_check_path={self.ready_file}",
                f"-health_check_path={d / 'healthy'}", f"-rocksdb_store_dir={d / 'rocksdb'}",
                f"-monitor_config_file={d / 'datasystem.config'}", "-log_monitor=false", "-arena_per_tenant=1"]

    def start(self, timeout: float = READY_TIMEOUT_S) -> "LocalYuanrongWorker":
        """Start the worker and wait for its ready file; YuanrongUnavailable (worker stopped, its
        directory removed) if it exits or is not ready within ``timeout``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)   # a stale one would say "ready" at once
        env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(
            [str(self.binary.parent / "lib"), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])}
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(), cwd=self.directory, env=env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_set_parent_death_signal if self.die_with_parent else None)
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() >= deadline:
                why = (f"exited with {self.proc.returncode}" if self.proc.poll() is not None
                       else f"not ready within {timeout:.0f}s")
                tail = self.log_tail()
                self.stop()
                raise YuanrongUnavailable(f"datasystem_worker on {self.address} {why}: {tail}")
            time.sleep(0.05)
        return self

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the worker's process group now (an outage); the directory stays for a restart."""
        if self.proc is not None:
            self._signal_group(signal.SIGKILL)
            self.proc.wait(10)

    def restart(self, timeout: float = READY_TIMEOUT_S) -> "LocalYuanrongWorker":
        """Start again on the same ports and directory (after :meth:`kill`)."""
        if self._log is not None:
            self._log.close()
        return self.start(timeout)

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the process group (SIGTERM, then SIGKILL) and remove the directory. Idempotent."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self._signal_group(signal.SIGTERM)
                try:
                    self.proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    pass
            self._signal_group(signal.SIGKILL)   # whatever of its group is left
            self.proc.wait(10)
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self.directory, ignore_errors=True)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)   # its own session: the group id is its pid
        except ProcessLookupError:
            pass
