"""What a video request asks for, and how its result travels: shared by the gateway and the generate worker.

Life of a video request on the wire::

    gateway: POST /v1/videos ──▶ VideoParams (all defaults resolved: size, frames, fps, steps, seed)
        ──Submit.params = VideoParams──▶ broker ──Task──▶ generate worker
    worker ──MediaResult(mime=PROGRESS_MIME, index=-1, data="<percent>")──▶ gateway   (after each step)
    worker ──MediaResult(mime=video/mp4, index=k, data=<base64 chunk k>)… finish on the last chunk──▶ gateway
    worker ──StageDone──▶ broker

The finished video travels as base64 split into chunks of at most :data:`MAX_CHUNK_CHARS`
characters (a multiple of 4, so each chunk decodes on its own): one bus message is capped at
``MAX_BODY_BYTES`` (8 MiB) and a video easily exceeds it. Chunk ``k`` has ``index = k``; the last
has ``finish``; the receiver keeps the first copy of each index (a retried stage resends the same
bytes: the seed is fixed) and has the whole file when chunks ``0..last`` are in.

Progress rides on the same message type with :data:`PROGRESS_MIME` and ``index = -1`` (never a
chunk index), because the bus has no progress message; it is advisory (dropped or reordered
updates only make the percentage lag) and the receiver keeps the maximum.

Its checks run where the gateway builds it (400 naming the param) and where the bus decodes it (a
malformed message), so a request the gateway let through is not rejected for its shape by the
worker; the model may still refuse a size its VAE cannot produce.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import msgspec

from omnirelay.errors import InvalidParam
from omnirelay.step_cache_params import StepCacheSpec

MAX_PROMPT_CHARS = 4000
MAX_SIDE = 1792              # pixels: OpenAI's largest video size is 1792x1024
SIZE_MULTIPLE = 8            # one latent per 8×8 pixels (Stable Diffusion's VAE)
MAX_FRAMES = 240
MAX_FPS = 60
MAX_SECONDS = 60
MAX_STEPS = 150
MAX_GUIDANCE = 50.0
MAX_SEED = 2**63 - 1
DEFAULT_FPS = 8

PROGRESS_MIME = "application/vnd.omnirelay.progress"
PROGRESS_INDEX = -1
# Room for the other fields and msgpack framing inside one bus message; a multiple of 4 so that
# every chunk is valid base64 on its own.
MAX_CHUNK_CHARS = (8 * 1024 * 1024 - 64 * 1024) // 4 * 4
MAX_VIDEO_BYTES = 512 * 1024 * 1024   # an encoded video larger than this fails with payload_too_large


class VideoParams(msgspec.Struct, tag="video", frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """prompt / negative_prompt: the text and what to steer away from; width, height: pixels,
    multiples of 8; num_frames: frames to generate; fps: frames per second of the encoded file
    (``num_frames / fps`` is the clip's length); num_inference_steps: denoising steps;
    guidance_scale: classifier-free guidance weight (≤ 1 turns it off); seed: the latents' seed
    (same seed and parameters, same video bytes); cache: this request's step caching
    (``extra_body`` ``cache_backend`` / ``cache_config``; None: the worker's ``--cache-backend``)."""

    prompt: str
    width: int
    height: int
    num_frames: int
    seed: int
    fps: int = DEFAULT_FPS
    negative_prompt: str = ""
    num_inference_steps: int = 50
    guidance_scale: float = 9.0
    cache: StepCacheSpec | None = None

    def __post_init__(self) -> None:
        for name in ("prompt", "negative_prompt"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise InvalidParam(f"'{name}' must be a string", param=name)
            if len(value) > MAX_PROMPT_CHARS:
                raise InvalidParam(f"'{name}' is longer than {MAX_PROMPT_CHARS} characters", param=name)
        if not self.prompt.strip():
            raise InvalidParam("'prompt' must not be empty", param="prompt")
        for name in ("width", "height"):
            value = getattr(self, name)
            check_int(value, name, SIZE_MULTIPLE, MAX_SIDE, param="size")
            if value % SIZE_MULTIPLE:
                raise InvalidParam(f"'{name}' must be a multiple of {SIZE_MULTIPLE}, got {value}", param="size")
        check_int(self.num_frames, "num_frames", 1, MAX_FRAMES)
        check_int(self.fps, "fps", 1, MAX_FPS)
        check_int(self.num_inference_steps, "num_inference_steps", 1, MAX_STEPS)
        check_int(self.seed, "seed", 0, MAX_SEED)
        if isinstance(self.guidance_scale, bool) or not isinstance(self.guidance_scale, (int, float)) \
                or not math.isfinite(self.guidance_scale) or not 0 <= self.guidance_scale <= MAX_GUIDANCE:
            raise InvalidParam(f"'guidance_scale' must be a number between 0 and {MAX_GUIDANCE}",
                             param="guidance_scale")
        msgspec.structs.force_setattr(self, "guidance_scale", float(self.guidance_scale))



def check_int(value: Any, name: str, lo: int, hi: int, param: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParam(f"'{name}' must be an integer", param=param or name)
    if not lo <= value <= hi:
        raise InvalidParam(f"'{name}' must be between {lo} and {hi}, got {value}", param=param or name)


# Video pipelines whose class name does not say "video".
VIDEO_PIPELINE_CLASSES = frozenset({"WanPipeline"})


def is_video_class(name: str) -> bool:
    """Whether a diffusers pipeline class makes video: its name says "video", or it is Wan's."""
    return "video" in name.lower() or name in VIDEO_PIPELINE_CLASSES


def is_video_pipeline(path: str | os.PathLike) -> bool:
    """A diffusers directory whose pipeline class makes video (:func:`is_video_class`, the rule
    ``deploy/served_models`` uses too)."""
    try:
        with open(os.path.join(path, "model_index.json")) as handle:
            index = json.load(handle)
    except (OSError, ValueError):
        return False
    return is_video_class(str(index.get("_class_name", "")) if isinstance(index, dict) else "")


def native_size(path: str | os.PathLike) -> tuple[int, int] | None:
    """(width, height) a UNet-based pipeline makes by default, from its config files: the
    denoiser's sample size times the VAE's downsampling; None when the files do not say."""
    try:
        with open(os.path.join(path, "unet", "config.json")) as handle:
            sample = json.load(handle).get("sample_size")
        with open(os.path.join(path, "vae", "config.json")) as handle:
            levels = len(json.load(handle).get("block_out_channels") or ())
    except (OSError, ValueError, AttributeError):
        return None
    if not levels:
        return None
    scale = 2 ** (levels - 1)
    if isinstance(sample, int):
        return sample * scale, sample * scale
    if isinstance(sample, list) and len(sample) == 2 and all(isinstance(s, int) for s in sample):
        return sample[1] * scale, sample[0] * scale
    return None
