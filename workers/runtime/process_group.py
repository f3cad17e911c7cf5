"""Joining and leaving the torch.distributed world: the one way every rank of every group does it.

Why this is not a bare ``init_process_group``: some torch modules take the world group as a default
argument (``def broadcast(tensor, src, group=group.WORLD)`` in ``torch.distributed.nn.functional``,
and two more in ``torch.distributed.optim`` and ``torch.distributed.fsdp``). The default is
evaluated when the module is first imported. Imported after the world was initialised (diffusers
pulls them in through ``torch._dynamo``, and a generate rank imports diffusers after it joins), the
defaults hold the world group for the rest of the process. ``destroy_process_group`` then cannot
free it, and its gloo run-loop threads outlive it. At interpreter exit, a run-loop thread that is
still releasing the tensors of the last collective must take the GIL during finalisation; CPython
ends that thread, and because it is inside C++ code, the process dies in ``std::terminate``. The
rank exits 134 after doing all its work, which looks like a crash to whoever owns it (systemd, the
worker that reaps its ranks, a test).

:func:`join_world` imports those modules before the world exists, so their defaults hold ``None``.
:func:`leave_world` can then free the world group, which joins its threads before the process
exits.
"""

from __future__ import annotations

import datetime
import importlib

import torch.distributed as dist

# Modules whose default arguments capture ``group.WORLD`` when they are imported (torch 2.13).
# tests/engine/test_process_group.py fails if a rank can no longer free its world after importing diffusers.
_WORLD_DEFAULT_HOLDERS = (
    "torch.distributed.nn.functional",
    "torch.distributed.optim.zero_redundancy_optimizer",
    "torch.distributed.fsdp.sharded_grad_scaler",
)


def join_world(backend: str, init_method: str, rank: int, world_size: int,
               timeout: datetime.timedelta | None = None) -> None:
    """Make this process ``rank`` of the world (``dist.init_process_group``), so that
    :func:`leave_world` can free the world again whatever is imported in between."""
    for module in _WORLD_DEFAULT_HOLDERS:
        importlib.import_module(module)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout)


def leave_world() -> None:
    """Destroy every process group of this process. The world group is freed here, with its
    threads joined, not at interpreter exit."""
    dist.destroy_process_group()
