"""A rank leaves torch.distributed's world with its gloo threads joined, even when it imported
diffusers (which pulls in torch modules whose ``group.WORLD`` default arguments would otherwise
hold the world group) after joining. Otherwise the threads outlive the group, and the process can
die in ``std::terminate`` at interpreter exit (exit 134).

Each check runs in a fresh interpreter. This test process has long since imported those modules,
so it could not show the failure."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from rank_processes import free_port

_RANK = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from omnirelay.workers.runtime.process_group import join_world, leave_world

    def gloo_threads():
        names = (open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task"))
        return sorted(name for name in names if "gloo" in name)

    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    join_world("gloo", f"tcp://127.0.0.1:{port}", rank, world)
    import diffusers, torch.distributed.fsdp, torch.distributed.optim   # after joining, as a generate rank does
    parts = [torch.empty(4) for _ in range(world)]
    dist.all_gather(parts, torch.full((4,), float(rank)))
    assert [int(part[0]) for part in parts] == list(range(world))
    assert gloo_threads(), "a live gloo group runs threads"
    leave_world()
    assert gloo_threads() == [], gloo_threads()
    print("left", rank)
""")


def test_leaving_the_world_joins_its_threads_after_diffusers_was_imported():
    port, world = free_port(), 2
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(world), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    try:
        results = [proc.communicate(timeout=120) for proc in ranks]
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, (out, err)) in enumerate(zip(ranks, results)):
        assert proc.returncode == 0, err[-2000:]
        assert out.split() == ["left", str(rank)]
