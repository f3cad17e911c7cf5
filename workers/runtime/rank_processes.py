"""The child processes of a worker's parallel group, whatever the engine: ranks 1..N-1 that rank 0
(the worker daemon) starts and owns. Shared by the LLM group (:mod:`omnirelay.workers.llm.parallel`)
and the diffusion sequence-parallel group (:mod:`omnirelay.workers.generate.sequence_parallel_group`).

A rank dies with its parent (:func:`die_with_parent`, the ``preexec_fn`` of every rank), so a
worker killed with -9 leaves no rank behind; a clean stop joins them (:func:`reap_ranks`).
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import subprocess


class ParallelGroupLost(RuntimeError):
    """A rank of the group stopped answering mid-step; the group cannot run another step. Not a
    per-request error: the runtime fails every request the worker holds as ``worker_lost`` and the
    worker exits 1 for its supervisor to restart it."""


def die_with_parent() -> None:
    """In a rank's child process before exec: the kernel kills it when its parent dies."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


def reap_ranks(procs: list[subprocess.Popen], tmp: str, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for each rank process (ours: started by the group) to exit, kill the
    ones that do not, and remove the group's rendezvous directory."""
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    procs.clear()
    shutil.rmtree(tmp, ignore_errors=True)
