"""Gloo rank processes for the sequence-parallel kernel tests (not a test module): the parent starts
one fresh interpreter per rank on a test script, waits for all of them, and loads what each saved;
the rank side joins the group over TCP on 127.0.0.1 and saves its output as ``rank{N}.safetensors``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from contextlib import contextmanager

import torch
from safetensors.torch import load_file, save_file

from omnirelay.workers.runtime.process_group import join_world, leave_world
from repo_paths import script_env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(script: str, world: int, result_dir, *extra: str) -> list[torch.Tensor]:
    """Run ``python script RANK WORLD PORT RESULT_DIR *extra`` for every rank; assert they all exit 0
    and return each rank's saved output, in rank order."""
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, script, str(rank), str(world), str(port), str(result_dir), *extra],
                              env=script_env())
             for rank in range(world)]
    try:
        codes = [proc.wait(timeout=240) for proc in ranks]
    finally:
        for proc in ranks:    # only on a timeout: a rank stuck in a collective
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert codes == [0] * world
    return [load_file(os.path.join(result_dir, f"rank{r}.safetensors"))["out"] for r in range(world)]


@contextmanager
def gloo_group(rank: int, world: int, port: int):
    """This process as ``rank`` of a gloo group (one torch thread), left on the way out."""
    torch.set_num_threads(1)
    join_world("gloo", f"tcp://127.0.0.1:{port}", rank, world)
    try:
        yield
    finally:
        leave_world()


def save_rank_output(out: torch.Tensor, rank: int, result_dir: str) -> None:
    save_file({"out": out.contiguous()}, os.path.join(result_dir, f"rank{rank}.safetensors"))
