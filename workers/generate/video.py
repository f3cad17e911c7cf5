"""The generate role for video: a diffusers text-to-video pipeline behind a pure ``step()`` engine.

Life of a request through the engine::

    add(VideoTask) ──▶ waiting (FIFO; one video is denoised at a time)
        ──admit the head──▶ running VideoJob
    VideoJob.phase: PROMPT (prompt embeddings, seeded latents, timesteps)
                ──▶ DENOISE (one scheduler step per engine step)
                ──▶ DECODE (the VAE, DECODE_FRAMES_PER_STEP frames per engine step)
                ──▶ MUX (frames → an MP4 file) ──▶ VideoOutput
    after every unit of work: a VideoProgress (percent of the job's units done)

One call of :meth:`GenerateVideoEngine.step` does one unit of that work, so the worker's loop
between calls takes new tasks, cancels requests and heartbeats even while a long video is made:
a cancelled request stops at the next step boundary (its latents are dropped and the next job is
admitted on the following step); a request past its deadline fails with ``deadline_exceeded``.

Batching: none. A video's latents are already a batch of frames, and a diffusion video job is long
enough that holding one request's frames while another finishes would only add latency; the
worker's capacity bounds how many requests wait.

Determinism: the latents come from a CPU ``torch.Generator`` seeded with the request's seed, so
the same seed and parameters give the same frames on any worker, and the encoder is run with one
thread, so the same frames give the same file bytes. The frames equal those of
``pipeline(prompt, num_frames=…, generator=torch.Generator().manual_seed(seed), output_type="np")``
(the VAE decodes frame slices instead of all frames at once, which can move a pixel by float
rounding).

Runners: :class:`TextToVideoSDPipeline` (a UNet3D, a per-frame VAE, a scheduler and a CLIP text
encoder) is driven step by step (:class:`StepwiseVideoRunner`); any other diffusers text-to-video
pipeline runs through its own ``__call__`` in one engine step (:class:`WholeCallVideoRunner`), so
it reports no progress in between and is not cancelled mid-denoise. ``WanPipeline`` (Wan 2.2, its
two experts switched at ``boundary_ratio``, UniPC over flow sigmas) is driven step by step too
(:class:`~.generate_wan.StepwiseWanRunner`, the whole clip decoded in one step); its sizes
(multiples of VAE factor × patch) and frame counts (4k + 1) come from :mod:`omnirelay.dit_families`,
which the gateway checks first.

File format (:func:`encode_video`): H.264 in MP4 (``video/mp4``, yuv420p, CRF 18) through PyAV
when it is installed — the format OpenAI's video API returns; without PyAV, a lossless animated
WebP (``image/webp``) through Pillow, so a deployment without the encoder still serves playable
video. The MIME type travels with the bytes.

No sockets here; the role adapter (``generate_video_role.py``) turns outputs into bus messages.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import importlib.util
import io
import logging
import time
from typing import Callable

import numpy as np
import torch

from omnirelay.dit_families import family_of_pipeline
from omnirelay.errors import BadRequest
from omnirelay.video_params import VideoParams

from omnirelay.workers.generate.image import load_pipeline

log = logging.getLogger("omnirelay.worker.generate")

DECODE_FRAMES_PER_STEP = 8     # VAE frames per engine step: bounds the time a cancel waits
MP4_MIME, WEBP_MIME = "video/mp4", "image/webp"


@dataclasses.dataclass(frozen=True)
class VideoTask:
    """One request: ``deadline`` is wall-clock seconds since the epoch (as on the bus)."""

    request_id: str
    params: VideoParams
    deadline: float


@dataclasses.dataclass(frozen=True)
class VideoOutput:
    request_id: str
    data: bytes
    mime: str
    frames: int


@dataclasses.dataclass(frozen=True)
class VideoProgress:
    request_id: str
    percent: int


@dataclasses.dataclass(frozen=True)
class VideoFailure:
    request_id: str
    error_type: str
    message: str


@dataclasses.dataclass
class StepOutput:
    videos: list[VideoOutput] = dataclasses.field(default_factory=list)
    progress: list[VideoProgress] = dataclasses.field(default_factory=list)
    failed: list[VideoFailure] = dataclasses.field(default_factory=list)


class JobPhase(enum.Enum):
    PROMPT = "prompt"
    DENOISE = "denoise"
    DECODE = "decode"
    MUX = "mux"


@dataclasses.dataclass
class VideoJob:
    """The running request. Tensors belong to the runner; ``frames`` collects decoded uint8 frames
    (num_frames × H × W × 3)."""

    task: VideoTask
    phase: JobPhase = JobPhase.PROMPT
    latents: torch.Tensor | None = None
    prompt_embeds: torch.Tensor | None = None
    generator: torch.Generator | None = None
    scheduler: object = None
    step_index: int = 0
    frames: list[np.ndarray] = dataclasses.field(default_factory=list)
    units_done: int = 0

    @property
    def params(self) -> VideoParams:
        return self.task.params

    @property
    def units_total(self) -> int:
        """Prompt + denoising steps + decode slices + mux: the denominator of progress."""
        slices = -(-self.params.num_frames // DECODE_FRAMES_PER_STEP)
        return 1 + self.params.num_inference_steps + slices + 1


# ---------------------------------------------------------------------------------------- runners


class StepwiseVideoRunner:
    """Drives a ``TextToVideoSDPipeline`` one phase, denoising step or decode slice per call,
    reproducing its ``__call__`` (eta 0, no cross-attention kwargs)."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.device = pipe.unet.device

    @torch.inference_mode()
    def advance(self, job: VideoJob) -> None:
        """Do the job's next unit of work; moves ``job.phase`` on (to MUX once every frame is decoded)."""
        pipe, params = self.pipe, job.params
        guided = params.guidance_scale > 1.0
        if job.phase is JobPhase.PROMPT:
            positive, negative = pipe.encode_prompt(params.prompt, self.device, 1, guided,
                                                    params.negative_prompt or None)
            job.prompt_embeds = torch.cat([negative, positive]) if guided else positive
            job.generator = torch.Generator().manual_seed(params.seed)
            job.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
            job.scheduler.set_timesteps(params.num_inference_steps, device=self.device)
            job.latents = pipe.prepare_latents(1, pipe.unet.config.in_channels, params.num_frames, params.height,
                                               params.width, positive.dtype, self.device, job.generator)
            job.phase = JobPhase.DENOISE
        elif job.phase is JobPhase.DENOISE:
            scheduler = job.scheduler
            t = scheduler.timesteps[job.step_index]
            latents = job.latents
            model_input = scheduler.scale_model_input(torch.cat([latents] * 2) if guided else latents, t)
            noise = pipe.unet(model_input, t, encoder_hidden_states=job.prompt_embeds, return_dict=False)[0]
            if guided:
                uncond, text = noise.chunk(2)
                noise = uncond + params.guidance_scale * (text - uncond)
            # The scheduler steps frames as a batch of images: (b, c, f, h, w) → (b·f, c, h, w) and back.
            b, c, f, h, w = latents.shape
            flat = latents.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
            noise = noise.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
            extra = pipe.prepare_extra_step_kwargs(job.generator, 0.0)
            flat = scheduler.step(noise, t, flat, **extra).prev_sample
            job.latents = flat[None, :].reshape(b, f, c, h, w).permute(0, 2, 1, 3, 4)
            job.step_index += 1
            if job.step_index >= len(scheduler.timesteps):
                job.phase = JobPhase.DECODE
        elif job.phase is JobPhase.DECODE:
            start = len(job.frames)
            part = job.latents[:, :, start:start + DECODE_FRAMES_PER_STEP]
            video = pipe.video_processor.postprocess_video(video=pipe.decode_latents(part), output_type="np")
            job.frames.extend(to_uint8(video[0]))
            if len(job.frames) >= params.num_frames:
                job.phase = JobPhase.MUX
                job.latents = job.prompt_embeds = None   # free them before the encoder runs
        else:
            raise AssertionError(f"runner asked to advance a job in phase {job.phase}")


class WholeCallVideoRunner:
    """Any text-to-video pipeline: one ``pipeline(...)`` call per job, in one engine step."""

    def __init__(self, pipe):
        self.pipe = pipe

    @torch.inference_mode()
    def advance(self, job: VideoJob) -> None:
        params = job.params
        kwargs = dict(prompt=params.prompt, num_frames=params.num_frames, width=params.width, height=params.height,
                      num_inference_steps=params.num_inference_steps, guidance_scale=params.guidance_scale,
                      generator=torch.Generator().manual_seed(params.seed), output_type="np")
        if params.negative_prompt:
            kwargs["negative_prompt"] = params.negative_prompt
        frames = self.pipe(**kwargs).frames[0]
        job.frames = list(to_uint8(np.asarray(frames)))
        job.phase = JobPhase.MUX


def runner_for(pipe):
    """The stepwise runner of a pipeline we can drive step by step, else the whole-call one."""
    from diffusers import TextToVideoSDPipeline, WanPipeline

    if isinstance(pipe, TextToVideoSDPipeline):
        return StepwiseVideoRunner(pipe)
    if isinstance(pipe, WanPipeline) and not pipe.config.expand_timesteps:
        from omnirelay.workers.generate.wan import StepwiseWanRunner   # imports this module's job types
        return StepwiseWanRunner(pipe)
    return WholeCallVideoRunner(pipe)


def to_uint8(frames: np.ndarray) -> list[np.ndarray]:
    """Float frames in [0, 1] (f × H × W × 3) → uint8 frames, rounded as diffusers rounds images."""
    return list((np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8))


# ---------------------------------------------------------------------------------------- encoding


def video_encoder() -> str:
    """The encoder this process uses: "mp4" with PyAV installed, else "webp"."""
    return "mp4" if importlib.util.find_spec("av") is not None else "webp"


def encode_video(frames: list[np.ndarray], fps: int, encoder: str | None = None) -> tuple[bytes, str]:
    """(file bytes, MIME type) of uint8 RGB frames: H.264 MP4 (PyAV) or lossless animated WebP."""
    encoder = encoder or video_encoder()
    if encoder == "mp4":
        return _encode_mp4(frames, fps), MP4_MIME
    if encoder == "webp":
        return _encode_webp(frames, fps), WEBP_MIME
    raise ValueError(f"unknown video encoder {encoder!r}")


def _encode_mp4(frames: list[np.ndarray], fps: int) -> bytes:
    import av

    height, width = frames[0].shape[:2]
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"   # yuv420p: what players expect
        stream.codec_context.thread_count = 1    # x264 with several threads is not bit-reproducible
        stream.options = {"crf": "18", "preset": "medium"}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def _encode_webp(frames: list[np.ndarray], fps: int) -> bytes:
    from PIL import Image

    images = [Image.fromarray(frame, mode="RGB") for frame in frames]
    buffer = io.BytesIO()
    images[0].save(buffer, format="WEBP", save_all=True, append_images=images[1:], duration=max(1, round(1000 / fps)),
                   loop=0, lossless=True)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------- engine


class GenerateVideoEngine:
    """Owns the pipeline, the waiting tasks and the running job. Not thread-safe: the worker's
    loop calls :meth:`add`, :meth:`cancel` and :meth:`step` from one thread."""

    def __init__(self, pipe, *, runner=None, encoder: str | None = None, clock: Callable[[], float] = time.time):
        self.pipe = pipe
        self.runner = runner or runner_for(pipe)
        self.encoder = encoder or video_encoder()
        self.clock = clock
        # Wan: sizes in multiples of VAE factor × patch, frames 4k + 1 (omnirelay.dit_families)
        self.family = family_of_pipeline(pipe)
        self.vae_scale_factor = int(pipe.vae_scale_factor_spatial if self.family else pipe.vae_scale_factor)
        self.patch_size = self.family.size_multiple // self.vae_scale_factor if self.family else 1
        self.waiting: collections.deque[VideoTask] = collections.deque()
        self.job: VideoJob | None = None
        self.stats: collections.Counter[str] = collections.Counter()

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                        **kwargs) -> "GenerateVideoEngine":
        return cls(load_pipeline(path, dtype, device), **kwargs)

    # ------------------------------------------------------------------ queue side

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.job is not None

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + (self.job is not None)

    def holds(self, request_id: str) -> bool:
        return (self.job is not None and self.job.task.request_id == request_id) or \
            any(t.request_id == request_id for t in self.waiting)

    def add(self, task: VideoTask) -> None:
        """Queue a request. Raises :class:`BadRequest` for a size this model cannot make and
        ValueError for a request id already held."""
        if self.holds(task.request_id):
            raise ValueError(f"request {task.request_id} is already held")
        multiple = self.vae_scale_factor * self.patch_size
        if task.params.width % multiple or task.params.height % multiple:
            raise BadRequest(f"this model makes video in multiples of {multiple} pixels, got "
                             f"{task.params.width}x{task.params.height}", param="size")
        if self.family is not None:
            self.family.check_frames(task.params.num_frames)
        self.waiting.append(task)

    def cancel(self, request_id: str) -> bool:
        """Forget a request wherever it is; returns whether it was held (unknown ids are ignored)."""
        held = self.holds(request_id)
        self.waiting = collections.deque(t for t in self.waiting if t.request_id != request_id)
        if self.job is not None and self.job.task.request_id == request_id:
            self.stats["cancelled_running"] += 1
            self.job = None
        return held

    # ------------------------------------------------------------------ the step

    def step(self) -> StepOutput:
        """One unit of work: admit the next job if none runs, then advance it by one unit."""
        out = StepOutput()
        self._expire(out)
        if self.job is None:
            if not self.waiting:
                return out
            self.job = VideoJob(self.waiting.popleft())
        job = self.job
        phase = job.phase
        request_id = job.task.request_id
        try:
            if phase is JobPhase.MUX:
                data, mime = encode_video(job.frames, job.params.fps, self.encoder)
            else:
                self.runner.advance(job)
        except torch.OutOfMemoryError as exc:
            self._fail(out, request_id, "out_of_memory", f"out of memory generating video: {exc}")
            return out
        except Exception as exc:   # a bug or a pipeline we cannot drive: fail this request, keep serving
            log.exception("video job %s failed in phase %s", request_id, phase.value)
            self._fail(out, request_id, "internal_error", f"video generation failed: {type(exc).__name__}: {exc}")
            return out
        self.stats[f"{phase.value}_steps"] += 1
        job.units_done += 1
        if phase is not JobPhase.MUX:
            out.progress.append(VideoProgress(request_id, min(99, 100 * job.units_done // job.units_total)))
            return out
        self.job = None
        self.stats["videos_generated"] += 1
        self.stats["frames_generated"] += len(job.frames)
        out.videos.append(VideoOutput(request_id, data, mime, len(job.frames)))
        return out

    def _expire(self, out: StepOutput) -> None:
        now = self.clock()
        for task in [t for t in self.waiting if now > t.deadline]:
            self._fail(out, task.request_id, "deadline_exceeded", "deadline passed while waiting to generate video")
        if self.job is not None and now > self.job.task.deadline:
            self._fail(out, self.job.task.request_id, "deadline_exceeded", "deadline passed while generating video")

    def _fail(self, out: StepOutput, request_id: str, error_type: str, message: str) -> None:
        self.waiting = collections.deque(t for t in self.waiting if t.request_id != request_id)
        if self.job is not None and self.job.task.request_id == request_id:
            self.job = None
        self.stats[f"failed_{error_type}"] += 1
        out.failed.append(VideoFailure(request_id, error_type, message))

    def load(self) -> dict:
        """Load figures for heartbeats: the running video and those waiting."""
        return {"running": int(self.job is not None), "waiting": len(self.waiting)}
