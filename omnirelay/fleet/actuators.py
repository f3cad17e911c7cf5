"""Actuators: how the autoscaler adds a worker of a role and takes one away.

Contract (every actuator):

* ``start(role) -> str`` starts one worker of ``role`` and returns its name; it does not wait for
  the worker to register (the autoscaler sees that in the broker's view).
* ``drain(role) -> str | None`` takes one worker of ``role`` away **by drain**: the worker gets
  SIGTERM (directly, or through ``systemctl stop`` / the Ray actor), unregisters, finishes what it
  holds within its ``--drain-timeout`` and exits. Nothing here sends SIGKILL to scale down. It
  picks the most recently started worker it owns (LIFO: the longest-lived keep their warm caches)
  and returns its name, or None when it owns none of that role.
* ``active(role) -> int``: workers of ``role`` this actuator started and has not drained.
* ``poll()`` reaps drains that finished (call it once per autoscaler step; non-blocking).
* ``close()`` drains everything it started and waits (shutdown of the autoscaler itself).

Actuators only ever touch workers they started: a worker started by hand or by ``omni-serve`` is
never drained by the autoscaler.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Protocol

log = logging.getLogger("omnirelay.fleet")


class Actuator(Protocol):
    def start(self, role: str) -> str: ...
    def drain(self, role: str) -> str | None: ...
    def active(self, role: str) -> int: ...
    def poll(self) -> None: ...
    def close(self) -> None: ...


class LocalProcessActuator:
    """Workers as child processes of this one (what ``omni-serve`` does for its fixed fleet).

    ``argv(role, index)`` is the worker's command after ``python -m`` (e.g. ``omnirelay.workers.daemon
    --role decode --model … --broker …``); each runs in its own session, output to
    ``LOG_DIR/ROLE-INDEX.log`` when ``log_dir`` is set. ``close()`` sends SIGTERM to all and waits
    ``close_grace_s``; only a worker still alive after that (a hung drain at shutdown) is killed."""

    def __init__(self, argv: Callable[[str, int], Sequence[str]], log_dir: str | None = None,
                 close_grace_s: float = 60.0, preexec_fn: Callable[[], None] | None = None):
        """``preexec_fn``: run in each child before exec (omni-serve passes its die-with-parent)."""
        self._argv, self._log_dir, self._grace, self._preexec = argv, log_dir, close_grace_s, preexec_fn
        self._running: dict[str, list[tuple[str, subprocess.Popen]]] = collections.defaultdict(list)
        self._draining: list[tuple[str, subprocess.Popen]] = []
        self._index = collections.Counter()
        self.events: list[tuple[str, str]] = []   # ("start" | "drain" | "exited", name), in order
        self.exit_codes: dict[str, int] = {}

    def start(self, role: str) -> str:
        index = self._index[role]
        self._index[role] += 1
        name = f"{role}-{index}"
        out = open(os.path.join(self._log_dir, f"{name}.log"), "a") if self._log_dir else subprocess.DEVNULL
        try:
            proc = subprocess.Popen([sys.executable, "-m", *self._argv(role, index)], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=self._preexec)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()   # the child holds its own descriptor
        self._running[role].append((name, proc))
        self.events.append(("start", name))
        log.info("autoscaler started %s (pid %d)", name, proc.pid)
        return name

    def drain(self, role: str) -> str | None:
        self.poll()
        if not self._running[role]:
            return None
        name, proc = self._running[role].pop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        self._draining.append((name, proc))
        self.events.append(("drain", name))
        log.info("autoscaler draining %s (pid %d)", name, proc.pid)
        return name

    def active(self, role: str) -> int:
        self.poll()
        return len(self._running[role])

    def pids(self, role: str) -> list[int]:
        return [proc.pid for _, proc in self._running[role]]

    def poll(self) -> None:
        for name, proc in list(self._draining):
            if proc.poll() is not None:
                self._draining.remove((name, proc))
                self.events.append(("exited", name))
                self.exit_codes[name] = proc.returncode
        for role, procs in self._running.items():
            # A worker that died on its own no longer counts; the autoscaler starts another if needed.
            for name, proc in [entry for entry in procs if entry[1].poll() is not None]:
                procs.remove((name, proc))
                self.events.append(("exited", name))
                self.exit_codes[name] = proc.returncode
                log.warning("autoscaled worker %s exited with code %s", name, proc.returncode)

    def close(self) -> None:
        procs = [entry for entries in self._running.values() for entry in entries] + self._draining
        for _, proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self._grace
        for name, proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("%s did not exit %.0fs after SIGTERM at shutdown; killing it", name, self._grace)
                proc.kill()
                proc.wait()
        self._running.clear()
        self._draining.clear()


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)


class SystemdActuator:
    """Workers as instances of the ``omni-worker@.service`` template (deploy/systemd): instance
    ``ROLE-N`` runs a worker of ROLE (the unit derives ``--role`` from the instance name up to the
    first ``-``). ``start`` runs ``systemctl start omni-worker@ROLE-N.service``; ``drain`` runs
    ``systemctl stop --no-block omni-worker@ROLE-N.service``: systemd sends the unit's KillSignal
    (SIGTERM) and waits TimeoutStopSec, so the worker drains; ``--no-block`` keeps the autoscaler's
    loop from waiting for it. ``runner`` executes one command line (default: ``subprocess.run``,
    check=True); ``systemctl`` may be a path or ``["sudo", "systemctl"]``-style prefix."""

    def __init__(self, runner: Callable[[list[str]], None] = _run, systemctl: Sequence[str] = ("systemctl",),
                 unit: str = "omni-worker", first_index: int = 100):
        self._runner, self._systemctl, self._unit = runner, list(systemctl), unit
        self._units: dict[str, list[str]] = collections.defaultdict(list)
        # Instances 0..first_index-1 are left to the operator's own enabled units.
        self._next = collections.Counter()
        self._first = first_index

    def command(self, verb: str, instance: str) -> list[str]:
        extra = ["--no-block"] if verb == "stop" else []
        return [*self._systemctl, verb, *extra, f"{self._unit}@{instance}.service"]

    def start(self, role: str) -> str:
        if "-" in role:
            raise ValueError(f"role {role!r}: the unit derives the role from the instance name up to its first '-'")
        instance = f"{role}-{self._first + self._next[role]}"
        self._next[role] += 1
        self._runner(self.command("start", instance))
        self._units[role].append(instance)
        return instance

    def drain(self, role: str) -> str | None:
        if not self._units[role]:
            return None
        instance = self._units[role].pop()
        self._runner(self.command("stop", instance))
        return instance

    def active(self, role: str) -> int:
        return len(self._units[role])

    def poll(self) -> None:
        """systemd supervises the drains (and restarts a unit that fails: Restart=on-failure)."""

    def close(self) -> None:
        for role in list(self._units):
            while self.drain(role) is not None:
                pass


class RayActuator:
    """Workers as Ray actors running ``omni-worker`` (:class:`~omnirelay.deploy.ray_launcher.DaemonActor`),
    one CPU (``num_cpus``) or ``num_gpus`` each, placed by Ray. ``argv(role, index)`` as for
    :class:`LocalProcessActuator`. ``drain`` calls the actor's ``stop`` (SIGTERM, then its drain) and
    keeps the reference; ``poll`` kills the actor once its worker has exited."""

    def __init__(self, argv: Callable[[str, int], Sequence[str]], num_cpus: float = 1.0, num_gpus: int = 0,
                 drain_s: float = 30.0):
        import ray

        from omnirelay.deploy.ray_launcher import DaemonActor, DaemonSpec
        self._ray, self._spec, self._argv = ray, DaemonSpec, argv
        self._remote = ray.remote(DaemonActor)
        self._num_cpus, self._num_gpus, self._drain_s = num_cpus, num_gpus, drain_s
        self._actors: dict[str, list[tuple[str, object]]] = collections.defaultdict(list)
        self._draining: list[tuple[str, object, object]] = []
        self._index = collections.Counter()

    def start(self, role: str) -> str:
        index = self._index[role]
        self._index[role] += 1
        name = f"{role}-autoscaled-{index}"
        spec = self._spec(name=name, argv=tuple(self._argv(role, index)), num_cpus=self._num_cpus,
                          num_gpus=self._num_gpus)
        actor = self._remote.options(num_cpus=self._num_cpus, num_gpus=self._num_gpus).remote(spec)
        self._actors[role].append((name, actor))
        return name

    def drain(self, role: str) -> str | None:
        if not self._actors[role]:
            return None
        name, actor = self._actors[role].pop()
        self._draining.append((name, actor, actor.stop.remote(self._drain_s)))
        return name

    def active(self, role: str) -> int:
        return len(self._actors[role])

    def poll(self) -> None:
        for entry in list(self._draining):
            name, actor, ref = entry
            ready, _ = self._ray.wait([ref], timeout=0)
            if ready:
                self._draining.remove(entry)
                self._ray.kill(actor)   # its worker has exited: the actor has nothing left to run

    def close(self) -> None:
        for role in list(self._actors):
            while self.drain(role) is not None:
                pass
        for name, actor, ref in self._draining:
            try:
                self._ray.get(ref, timeout=self._drain_s + 10)
            finally:
                self._ray.kill(actor)
        self._draining.clear()
