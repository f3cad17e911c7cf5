"""Sequence parallelism for the Z-Image and Wan diffusion transformers, wired into a generate worker
(:mod:`omnirelay.workers.generate.sequence_parallel_group` picks each family's kernel from
:mod:`omnirelay.workers.generate.sequence_parallel_kernels`).

* Float: the tiny pipelines' own ``__call__`` over a group of real rank processes (rank 0 in this
  process, as the worker runs it) gives the same latents as one rank, within float tolerance — at
  sizes whose token count splits evenly and at sizes that need the kernels' padding.
* End to end: a real ``omni-worker --role generate`` with ``sequence_parallel_size: 2`` in its stage
  YAML, behind the real broker and gateway, makes the images (official ``openai`` client) and the
  video (``/v1/videos``) of the single-rank worker for the same seed.
* A video worker whose rank dies exits 1 for a restart, leaving no rank; a pipeline whose
  transformer has no kernel is refused at start-up (never run unsplit).

Equality through the gateway is on 8-bit pixels: the two-rank forward computes each rank's
projections on a slice of the tokens, so a GEMM may round the last float bit differently, and a
pixel on a .5 boundary can flip one level (see tests/e2e/test_generate_sp.py). On this machine the
files come out identical.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from omnirelay.deploy.builders.wan import build_tiny_wan
from omnirelay.deploy.builders.zimage import build_tiny_zimage
from omnirelay.workers.generate.image import load_pipeline
from omnirelay.workers.generate.sequence_parallel_group import (SequenceParallelDenoiser, SequenceParallelError,
                                                                check_sequence_parallel)

from cluster import Cluster
from sequence_parallel_support import (alive, assert_same_images, children, generate_png, group_stats, only_worker,
                                      serve_one_rank_then_two, sp_yaml)
from media_support import decode_frames
from repo_paths import REPO_ROOT

PROMPT = "a red fox sitting in the snow at dawn"


@pytest.fixture(scope="module")
def tiny_zimage(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return str(build_tiny_zimage(tmp_path_factory.mktemp("models") / "tiny-zimage", seed=0))


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return str(build_tiny_wan(tmp_path_factory.mktemp("models") / "tiny-wan", seed=0))


# ------------------------------------------------------------------------------- float equality


def _zimage_latents(pipe, width: int, height: int) -> torch.Tensor:
    # guided: the transformer sees a list of two latents and two captions of different lengths
    return pipe(PROMPT, negative_prompt="blurry", width=width, height=height, num_inference_steps=3,
                guidance_scale=2.0, generator=torch.Generator().manual_seed(5), output_type="latent").images


def _wan_latents(pipe, width: int, height: int, frames: int) -> torch.Tensor:
    # 3 steps from timestep 999 with boundary 0.875: both experts run, each twice per step (guided)
    return pipe(PROMPT, width=width, height=height, num_frames=frames, num_inference_steps=3, guidance_scale=4.0,
                generator=torch.Generator().manual_seed(5), output_type="latent").frames


def _split_equals_whole(model_dir: str, make, cases: list[tuple], world: int = 2) -> float:
    """Run ``make(pipe, *case)`` for every case on one rank, then over ``world`` ranks; assert the
    latents agree within float tolerance and return the largest absolute difference."""
    pipe = load_pipeline(model_dir)
    reference = [make(pipe, *case) for case in cases]
    group = SequenceParallelDenoiser(model_dir, world)
    try:
        group.attach(*group.experts_of(pipe))
        split = [make(pipe, *case) for case in cases]
        forwards = group.stats["sp_forwards"]
    finally:
        group.close()
    assert all("forward" not in expert.__dict__ for expert in group.experts)   # close put them back
    assert forwards >= 3 * len(cases)   # every denoising step ran over the group
    worst = 0.0
    for case, got, want in zip(cases, split, reference):
        assert got.shape == want.shape and want.std() > 0.5, case
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case}: {m}")
        worst = max(worst, (got - want).abs().max().item())
    return worst


def test_zimage_over_two_ranks_equals_one_rank_within_float_tolerance(tiny_zimage):
    # 96x64: 6×4 image tokens; 48x48: 3×3 = 9, so the unified sequence needs the kernel's padding
    worst = _split_equals_whole(tiny_zimage, _zimage_latents, [(96, 64), (48, 48)])
    print(f"Z-Image SP=2 vs SP=1: max |latent difference| {worst:.3g}")


def test_wan_over_two_ranks_equals_one_rank_within_float_tolerance(tiny_wan):
    # 64x48, 5 frames: 2 latent frames × 3×4 patches = 24 tokens; 48x48, 1 frame: 9 (padded to 10)
    worst = _split_equals_whole(tiny_wan, _wan_latents, [(64, 48, 5), (48, 48, 1)])
    print(f"Wan SP=2 vs SP=1: max |latent difference| {worst:.3g}")


# ----------------------------------------------------------------------------------- end to end

ZIMAGE = "tiny-zimage"
IMAGE_YAML = str(REPO_ROOT / "deploy" / "pipelines" / "text_to_image.yaml")
# (size, guidance): guided runs both captions in one transformer call; 48x48 is 9 tokens (padded)
IMAGE_REQUESTS = [("96x64", 2.0), ("48x48", 0.0)]


def _image(client, size: str, guidance: float, seed: int = 11) -> np.ndarray:
    return generate_png(client, ZIMAGE, PROMPT, size, {"seed": seed, "num_inference_steps": 3,
                                                       "guidance_scale": guidance})


# ~140 s each on a loaded 2-core box: two workers, a gateway and a broker start per test
@pytest.mark.slow
def test_zimage_two_rank_worker_makes_the_single_rank_workers_images(tiny_zimage, tmp_path):
    with Cluster(model=tiny_zimage, log_dir=str(tmp_path), model_name=ZIMAGE) as cluster:
        client, split, reference = serve_one_rank_then_two(
            cluster, IMAGE_YAML, tmp_path, lambda client: [_image(client, *request) for request in IMAGE_REQUESTS])
        images = [_image(client, size, guidance) for size, guidance in IMAGE_REQUESTS]
        assert_same_images(images, reference, [f"Z-Image {size}" for size, _ in IMAGE_REQUESTS])
        # 3 steps × 2 images, every one over the group
        assert group_stats(cluster).get("sp_forwards", 0) == 6
        assert split.stop() == 0   # drains, closes the engine, which stops and joins rank 1
    assert "Traceback" not in split.output(), split.output()[-3000:]


WAN = "tiny-wan"
VIDEO_YAML = str(REPO_ROOT / "deploy" / "pipelines" / "text_to_video.yaml")


def _video(client, seed: int = 5) -> tuple[list[np.ndarray], bytes]:
    video = client.videos.create(model=WAN, prompt=PROMPT, size="64x48",
                                 extra_body={"seed": seed, "num_inference_steps": 3, "num_frames": 9,
                                             "guidance_scale": 4.0})
    deadline = time.monotonic() + 120
    while (video := client.videos.retrieve(video.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, video
        time.sleep(0.1)
    assert video.status == "completed", video.error
    content = client.videos.download_content(video.id)
    data = content.read()
    frames, _ = decode_frames(data, content.response.headers["content-type"])
    assert len(frames) == 9 and frames[0].shape == (48, 64, 3)
    return [frame.astype(np.int16) for frame in frames], data


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")   # the openai client's notice
def test_wan_two_rank_worker_makes_the_single_rank_workers_video(tiny_wan, tmp_path):
    with Cluster(model=tiny_wan, log_dir=str(tmp_path), model_name=WAN) as cluster:
        client, split, (reference, reference_file) = serve_one_rank_then_two(cluster, VIDEO_YAML, tmp_path, _video)
        frames, split_file = _video(client)
        diff = np.abs(np.stack(frames) - np.stack(reference))
        print(f"Wan SP=2 vs SP=1: max pixel difference {diff.max()}, identical files {split_file == reference_file}")
        # A flipped pixel can move a few more through the lossy H.264 encoder; the video stays the same.
        assert diff.max() <= 8 and diff.mean() < 0.1, (diff.max(), diff.mean())
        assert np.stack(reference).std() > 5
        # 3 steps, each a conditional and an unconditional call (or one call over both rows, batched)
        assert group_stats(cluster).get("sp_forwards", 0) in (3, 6)
        ranks = children(split.pid)
        assert len(ranks) == 1, ranks
        assert split.stop() == 0   # drains, closes the group, which stops and joins rank 1
        assert not any(alive(pid) for pid in ranks)

        # A rank of an idle video worker dies: the worker notices, stops taking work and exits 1 for
        # its supervisor to restart it, leaving no rank behind.
        lost = cluster.start_worker("generate", "--stage-configs-path", sp_yaml(tmp_path, 2))
        only_worker(cluster, 2)
        [rank] = children(lost.pid)
        os.kill(rank, signal.SIGKILL)
        assert lost.proc.wait(60) == 1, lost.output()[-3000:]
        assert "sequence-parallel group lost" in lost.output() and not alive(rank)
    for worker in (split, lost):
        assert "Traceback" not in worker.output(), worker.output()[-3000:]


# ------------------------------------------------------------------------------------ refusals


def test_kernels_cover_both_dits_at_any_size_and_other_transformers_are_refused(tiny_zimage, tiny_wan, tmp_path):
    for model_dir in (tiny_zimage, tiny_wan):   # the kernels pad: every size splits
        for size in (2, 3, 7):
            check_sequence_parallel(model_dir, size)
    flux = tmp_path / "flux"
    flux.mkdir()
    (flux / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline",
                                                       "transformer": ["diffusers", "FluxTransformer2DModel"]}))
    with pytest.raises(SequenceParallelError, match=r"FluxPipeline\) has FluxTransformer2DModel; use "
                                                    r"sequence_parallel_size 1"):
        check_sequence_parallel(str(flux), 2)
    # The worker refuses before loading anything, exit status 2, the reason and the kernels on stderr.
    proc = subprocess.run([sys.executable, "-m", "omnirelay.workers.daemon", "--role", "generate", "--model",
                           str(flux), "--broker", "tcp://127.0.0.1:9", "--sequence-parallel-size", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("has a sequence-parallel kernel (SD3Transformer2DModel, ZImageTransformer2DModel, "
            "WanTransformer3DModel)") in proc.stderr and "FluxTransformer2DModel" in proc.stderr
