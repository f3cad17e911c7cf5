"""Where a worker's ranks run and how much device memory their KV pools may take.

Placement (:func:`resolve_devices`): ``omni-worker --devices 0,1`` names the worker's GPU group;
rank ``i`` of the group (``world = tensor × pipeline parallel size``) runs on ``cuda:<i-th id>``.
Without ``--devices``, a host with CUDA gives rank ``i`` the ``i``-th visible device (``cuda:i``,
so ``CUDA_VISIBLE_DEVICES`` — which Ray sets for an actor's ``num_gpus`` — decides which ones), and
a host without CUDA runs every rank on the CPU. ``--devices`` on a host without CUDA is an error:
running on the CPU when a GPU group was asked for would only hide a broken driver or build.

KV budget (:func:`kv_cache_budget`), measured on each rank after its weights are loaded:

* CUDA: the worker owns ``utilization × total`` of its rank's device — its share, as in vLLM:
  weights, activations and KV pool together. The pool takes the share minus what this process has
  already reserved (its weights, measured by torch's allocator), and never more than is free right
  now, because other workers may own the rest of the device. Several workers on one device split it
  by their utilizations (``omni-serve`` divides ``--gpu-memory-utilization`` among the workers it
  starts on one host's devices). An explicit ``--kv-cache-bytes`` caps that: the pool takes the
  smaller of the two, so a byte budget never over-commits the device and a utilization never
  exceeds what the operator wrote down.
* CPU: ``--kv-cache-bytes`` (default :data:`DEFAULT_CPU_KV_BYTES`); there is no device memory to
  measure, so ``--gpu-memory-utilization`` does not apply.

Every rank of a group uses the same block ids, so the group takes the smallest block count any
rank can hold (:mod:`omnirelay.workers.llm.parallel`). A pool of fewer than two blocks (block 0 is the
padding target) fails start-up with :class:`KVBudgetError`, which names the numbers.
"""

from __future__ import annotations

import torch

DEFAULT_CPU_KV_BYTES = 256 * 1024 * 1024
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


class KVBudgetError(ValueError):
    """The KV pool would not hold one usable block; the worker cannot start."""


def parse_device_ids(text: str) -> tuple[int, ...]:
    """``"0,1"`` → ``(0, 1)``; distinct non-negative integers only."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or not all(item.isdigit() for item in items) or len(set(map(int, items))) != len(items):
        raise ValueError(f"--devices {text!r}: expected distinct device ids like 0,1")
    return tuple(int(item) for item in items)


def resolve_devices(devices: tuple[int, ...], world: int, *, cuda_count: int | None = None) -> tuple[str, ...]:
    """Torch device names of ranks ``0 .. world-1``. ``cuda_count``: visible CUDA devices (default:
    ask torch; a test passes it)."""
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = ",".join(map(str, devices))
    if devices:
        if len(devices) != world:
            raise ValueError(f"--devices {listed} names {len(devices)} device(s) for a group of {world} rank(s)")
        if cuda_count == 0:
            raise ValueError(f"--devices {listed}: this host has no CUDA device (torch {torch.__version__}, "
                             "torch.cuda.is_available() is False); leave --devices out to run on the CPU")
        missing = [d for d in devices if d >= cuda_count]
        if missing:
            raise ValueError(f"--devices {listed}: device {missing[0]} does not exist; {cuda_count} CUDA "
                             f"device(s) are visible (0..{cuda_count - 1})")
        return tuple(f"cuda:{d}" for d in devices)
    if cuda_count == 0:
        return ("cpu",) * world
    if world > cuda_count:
        raise ValueError(f"a group of {world} ranks needs {world} CUDA devices but {cuda_count} are visible; "
                         "lower the parallel sizes or make more devices visible")
    return tuple(f"cuda:{i}" for i in range(world))


def kv_cache_budget(*, total: int, free: int, own: int, utilization: float, explicit: int = 0) -> int:
    """Bytes a CUDA rank's KV pool may take (see the module docstring): the worker's share
    ``utilization × total`` minus ``own`` (bytes this process already reserved), at most ``free``,
    capped by ``explicit`` when it is non-zero. Never negative; pure, so the rule is tested without
    a device."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization {utilization}: must be in (0, 1]")
    if total <= 0 or not 0 <= free <= total or not 0 <= own <= total:
        raise ValueError(f"device memory total {total} / free {free} / own {own} bytes is not a valid reading")
    budget = min(int(utilization * total) - own, free)
    if explicit > 0:
        budget = min(budget, explicit)
    return max(budget, 0)


def blocks_in_budget(budget: int, bytes_per_block: int, where: str) -> int:
    """Blocks of ``bytes_per_block`` in ``budget``; fewer than two is a :class:`KVBudgetError`."""
    blocks = budget // bytes_per_block
    if blocks < 2:
        raise KVBudgetError(f"KV cache on {where}: a budget of {budget} bytes holds {blocks} block(s) of "
                            f"{bytes_per_block} bytes, at least 2 are needed (one is padding); raise --kv-cache-bytes "
                            "(on CUDA: --gpu-memory-utilization, or free the device), or lower --block-size")
    return blocks


def rank_kv_budget(device: torch.device, utilization: float, explicit: int) -> tuple[int, str]:
    """This rank's KV budget in bytes (after its weights are loaded) and a description of where it
    came from for error messages."""
    if device.type != "cuda":
        budget = explicit or DEFAULT_CPU_KV_BYTES
        return budget, f"{device} (--kv-cache-bytes {budget})"
    # Loading leaves freed temporaries in torch's cache: they would count as this worker's own.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    own = torch.cuda.memory_reserved(device)
    budget = kv_cache_budget(total=total, free=free, own=own, utilization=utilization, explicit=explicit)
    return budget, (f"{device} (--gpu-memory-utilization {utilization} of {total} bytes, {own} taken by this "
                    f"worker, {free} free" + (f", --kv-cache-bytes {explicit}" if explicit else "") + ")")
