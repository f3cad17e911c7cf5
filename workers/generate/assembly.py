"""What the image and video role builders share: where rank 0 runs, the sequence-parallel group
that ranks 1..N-1 form, and the heartbeat stats of a denoising engine."""

from __future__ import annotations

from typing import Callable

import torch

from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.generate.sequence_parallel_group import SequenceParallelDenoiser


def start_denoiser_ranks(config: WorkerConfig, on_lost: Callable[[str], None] | None
                         ) -> tuple[str, SequenceParallelDenoiser | None]:
    """The device this process loads the pipeline on, and with ``config.sequence_parallel_size`` > 1
    the group of the other ranks, started first so that they load their transformers while this
    process loads the pipeline (the caller closes it if that fails). The group's collectives are gloo
    on the CPU (as the TP/PP group's), so rank 0 stays there too; without a group, the first CUDA
    device when there is one. ``on_lost(reason)``: called once, from any thread, if the group loses a rank."""
    sp_size = config.sequence_parallel_size
    device = "cuda" if torch.cuda.is_available() and sp_size == 1 else "cpu"
    group = SequenceParallelDenoiser(config.model_path, sp_size, config.threads, on_lost=on_lost) if sp_size > 1 else None
    return device, group


def denoiser_dtype(pipe) -> torch.dtype:
    """The dtype the denoiser really holds (what --dtype asked for, unless the pipeline pins it):
    logged and heartbeated, so a deployment can see that its --dtype took effect."""
    denoiser = pipe.components.get("unet") or pipe.components.get("transformer")
    return next(denoiser.parameters()).dtype


def denoising_stats(engine, group: SequenceParallelDenoiser | None, weights: torch.dtype,
                    sp_size: int) -> Callable[[], dict]:
    """The heartbeat stats of an image or video engine (its load and counters) and of its group."""
    weight_bits = weights.itemsize * 8

    def stats() -> dict:
        sp = group.stats if group is not None else {}
        return {**engine.load(), **engine.stats, **sp, "denoiser_weight_bits": weight_bits,
                "sequence_parallel_size": sp_size}

    return stats
