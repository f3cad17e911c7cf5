"""The generate role for video: a diffusers text-to-video pipeline behind a pure ``step()`` engine.

Life of a request through the engine::

    add(VideoTask) ──▶ waiting (FIFO)
        ──admit: the head plus up to max_batch_size-1 waiting tasks with the same batch key
          (width, height, frames, steps, guidance scale, step cache)──▶ running VideoJob (row i:
          tasks[i]) with a StepCache of its own (the request's ``cache`` or the server's)
    VideoJob.phase: PROMPT (prompt embeddings of every row, seeded latents, timesteps)
                ──▶ DENOISE (one scheduler step of the whole batch per engine step)
                ──▶ DECODE (the VAE, DECODE_FRAMES_PER_STEP frames of every row per engine step)
                ──▶ MUX (one row's frames → a file per engine step, at that request's fps) ──▶ VideoOutput
    after every unit of work: a VideoProgress per row (percent of the job's units done)

One call of :meth:`GenerateVideoEngine.step` does one unit of that work, so the worker's loop
between calls takes new tasks, cancels requests and heartbeats even while a long video is made.
A cancelled request leaves the running batch at the next step boundary: its rows are cut out of
the latents, the prompt embeddings and the scheduler's per-sample state (a multistep solver's
history), and the other rows go on as if it had never been there; a request past its deadline
fails with ``deadline_exceeded`` the same way. A failure of the batch's pipeline work fails every
request of the batch (a mux failure only the request being encoded); waiting requests go on.

Batching (``runtime.max_batch_size`` of the stage, or the worker's ``--capacity``; default 1):
requests that can share one denoising loop — same size, frame count, step count, guidance scale
and step cache — run as one batch, each row with its own prompt, negative prompt and seed; requests of other
shapes wait for the next batch (never mixed, never overtaken by a later request of their own
key). The fps only matters to the mux, so it is not part of the key.

Determinism: each request's latents come from its own CPU ``torch.Generator`` seeded with its seed
(diffusers' list-of-generators form), so the same seed and parameters give the same frames on any
worker and whatever shares the batch (bit-exact for a batch of one; in a larger batch float
rounding can move a pixel by one), and the encoder runs with one thread and no B-frames, so the same
frames give the same file bytes. A batch of one equals
``pipeline(prompt, num_frames=…, generator=torch.Generator().manual_seed(seed), output_type="np")``
(the VAE decodes frame slices instead of all frames at once, which can move a pixel by float
rounding).

Runners: :class:`TextToVideoSDPipeline` (a UNet3D, a per-frame VAE, a scheduler and a CLIP text
encoder) is driven step by step (:class:`StepwiseVideoRunner`); any other diffusers text-to-video
pipeline runs through its own ``__call__`` in one engine step (:class:`WholeCallVideoRunner`, a
batch as lists of prompts and generators), so it reports no progress in between and is not
cancelled mid-denoise. ``WanPipeline`` (Wan 2.2, its two experts switched at ``boundary_ratio``,
UniPC over flow sigmas) is driven step by step too (:class:`~.wan.StepwiseWanRunner`, the whole
clip decoded in one step); its sizes (multiples of VAE factor × patch) and frame counts (4k + 1)
come from :mod:`omnirelay.dit_families`, which the gateway checks first.

File format (:func:`encode_video`): H.264 in MP4 (``video/mp4``, yuv420p, CRF 18) through PyAV
when it is installed — the format OpenAI's video API returns; without PyAV, a lossless animated
WebP (``image/webp``) through Pillow, so a deployment without the encoder still serves playable
video. The MIME type travels with the bytes.

No sockets here; the role adapter (``video_role.py``) turns outputs into bus messages.
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
from omnirelay.errors import BadRequest, DeadlineExceeded, OmniError, OutOfMemory, Unprocessable
from omnirelay.step_cache_params import StepCacheSpec
from omnirelay.video_params import VideoParams

from omnirelay.workers.generate.image import load_pipeline
from omnirelay.workers.generate.step_cache import StepCache
from omnirelay.workers.runtime.engine import RequestFailure
from omnirelay.workers.runtime.request_queue import RequestQueue

log = logging.getLogger("omnirelay.worker.generate")

DECODE_FRAMES_PER_STEP = 8     # VAE frames (of every row) per engine step: bounds the time a cancel waits
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


@dataclasses.dataclass
class StepOutput:
    videos: list[VideoOutput] = dataclasses.field(default_factory=list)
    progress: list[VideoProgress] = dataclasses.field(default_factory=list)
    failed: list[RequestFailure] = dataclasses.field(default_factory=list)


class JobPhase(enum.Enum):
    PROMPT = "prompt"
    DENOISE = "denoise"
    DECODE = "decode"
    MUX = "mux"


def batch_key(params: VideoParams) -> tuple:
    """What requests must share to run in one denoising loop: the latents' shape, the timesteps
    and the guidance applied to every row."""
    return (params.width, params.height, params.num_frames, params.num_inference_steps, params.guidance_scale,
            params.cache)


@dataclasses.dataclass
class VideoJob:
    """The running batch: row ``i`` of every tensor is ``tasks[i]`` (all of one :func:`batch_key`).
    Tensors belong to the runner; ``frames[i]`` collects row ``i``'s decoded uint8 frames
    (num_frames × H × W × 3)."""

    tasks: list[VideoTask]
    phase: JobPhase = JobPhase.PROMPT
    latents: torch.Tensor | None = None
    prompt_embeds: torch.Tensor | None = None
    negative_embeds: torch.Tensor | None = None     # under guidance
    generators: list[torch.Generator] = dataclasses.field(default_factory=list)
    scheduler: object = None
    step_index: int = 0
    frames: list[list[np.ndarray]] = dataclasses.field(default_factory=list)
    units_done: int = 0
    step_cache: StepCache | None = None             # made at admission: this batch's alone

    @property
    def params(self) -> VideoParams:
        """The head request's parameters: the shape, steps and guidance every row shares (prompts,
        seeds and fps are per row, in ``tasks``)."""
        return self.tasks[0].params

    @property
    def guided(self) -> bool:
        return self.params.guidance_scale > 1.0

    @property
    def units_total(self) -> int:
        """Prompt + denoising steps + decode slices + a row's mux: the denominator of progress."""
        slices = -(-self.params.num_frames // DECODE_FRAMES_PER_STEP)
        return 1 + self.params.num_inference_steps + slices + 1


def keep_rows(job: VideoJob, rows: list[int], *, frames_in_scheduler_batch: bool = False) -> None:
    """Cut every row not in ``rows`` out of a batch in flight: its task, generator, decoded frames,
    latents, prompt embeddings and the scheduler's per-sample state. ``frames_in_scheduler_batch``:
    the scheduler steps the latents as ``(rows·frames, C, H, W)`` (a per-frame scheduler) rather
    than as they are."""
    latents = job.latents
    if latents is not None and job.scheduler is not None:
        frames = latents.shape[2]
        if frames_in_scheduler_batch:
            b, c, f, h, w = latents.shape
            sample_shape = (b * f, c, h, w)
            sample_rows = [r * frames + k for r in rows for k in range(frames)]
        else:
            sample_shape, sample_rows = tuple(latents.shape), rows
        _cut_scheduler_state(job.scheduler, sample_shape,
                             torch.tensor(sample_rows, dtype=torch.long, device=latents.device))
    if job.step_cache is not None:
        job.step_cache.keep_rows(torch.tensor(rows, dtype=torch.long))
    job.tasks = [job.tasks[i] for i in rows]
    job.generators = [job.generators[i] for i in rows] if job.generators else []
    job.frames = [job.frames[i] for i in rows] if job.frames else []
    for name in ("latents", "prompt_embeds", "negative_embeds"):
        tensor = getattr(job, name)
        if tensor is not None:
            setattr(job, name, tensor.index_select(0, torch.tensor(rows, dtype=torch.long, device=tensor.device)))


def _cut_scheduler_state(scheduler, sample_shape: tuple, index: torch.Tensor) -> None:
    """Keep the ``index`` rows of every tensor the scheduler holds that is shaped as the sample it
    steps (a multistep solver's past model outputs, UniPC's last sample): their rows are the
    batch's rows. Tables of the schedule (sigmas, timesteps) never have that shape."""
    def cut(value):
        if isinstance(value, torch.Tensor) and tuple(value.shape) == sample_shape:
            return value.index_select(0, index.to(value.device))
        return value

    for name, value in list(vars(scheduler).items()):
        if isinstance(value, torch.Tensor):
            setattr(scheduler, name, cut(value))
        elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            setattr(scheduler, name, type(value)(cut(v) for v in value))


# ---------------------------------------------------------------------------------------- runners


class StepwiseVideoRunner:
    """Drives a ``TextToVideoSDPipeline`` one phase, denoising step or decode slice per call,
    reproducing its ``__call__`` (eta 0, no cross-attention kwargs) over a batch of rows."""

    caches_steps = False     # a UNet: no step cache (the DiT families' runners have one)

    def __init__(self, pipe):
        self.pipe = pipe
        self.device = pipe.unet.device

    @torch.inference_mode()
    def advance(self, job: VideoJob) -> None:
        """Do the job's next unit of work; moves ``job.phase`` on (to MUX once every frame is decoded)."""
        pipe, params, guided = self.pipe, job.params, job.guided
        if job.phase is JobPhase.PROMPT:
            tasks = job.tasks
            positive, negative = pipe.encode_prompt([t.params.prompt for t in tasks], self.device, 1, guided,
                                                    [t.params.negative_prompt for t in tasks])
            job.prompt_embeds, job.negative_embeds = positive, negative
            job.generators = [torch.Generator().manual_seed(t.params.seed) for t in tasks]
            job.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
            job.scheduler.set_timesteps(params.num_inference_steps, device=self.device)
            job.latents = pipe.prepare_latents(len(tasks), pipe.unet.config.in_channels, params.num_frames,
                                               params.height, params.width, positive.dtype, self.device,
                                               job.generators)
            job.phase = JobPhase.DENOISE
        elif job.phase is JobPhase.DENOISE:
            scheduler = job.scheduler
            t = scheduler.timesteps[job.step_index]
            latents = job.latents
            model_input = scheduler.scale_model_input(torch.cat([latents] * 2) if guided else latents, t)
            embeds = torch.cat([job.negative_embeds, job.prompt_embeds]) if guided else job.prompt_embeds
            noise = pipe.unet(model_input, t, encoder_hidden_states=embeds, return_dict=False)[0]
            if guided:
                uncond, text = noise.chunk(2)
                noise = uncond + params.guidance_scale * (text - uncond)
            # The scheduler steps frames as a batch of images: (b, c, f, h, w) → (b·f, c, h, w) and back.
            b, c, f, h, w = latents.shape
            flat = latents.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
            noise = noise.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
            # eta 0: a deterministic scheduler draws nothing. One that draws (ancestral) gets the head
            # row's generator, since its draws span every row's frames at once.
            extra = pipe.prepare_extra_step_kwargs(job.generators[0], 0.0)
            flat = scheduler.step(noise, t, flat, **extra).prev_sample
            job.latents = flat[None, :].reshape(b, f, c, h, w).permute(0, 2, 1, 3, 4)
            job.step_index += 1
            if job.step_index >= len(scheduler.timesteps):
                job.phase = JobPhase.DECODE
        elif job.phase is JobPhase.DECODE:
            if not job.frames:
                job.frames = [[] for _ in job.tasks]
            start = len(job.frames[0])
            part = job.latents[:, :, start:start + DECODE_FRAMES_PER_STEP]
            video = pipe.video_processor.postprocess_video(video=pipe.decode_latents(part), output_type="np")
            for row, frames in zip(job.frames, video):
                row.extend(to_uint8(frames))
            if len(job.frames[0]) >= params.num_frames:
                job.phase = JobPhase.MUX
                job.latents = job.prompt_embeds = job.negative_embeds = None   # free them before the encoder runs
        else:
            raise AssertionError(f"runner asked to advance a job in phase {job.phase}")

    def keep_rows(self, job: VideoJob, rows: list[int]) -> None:
        keep_rows(job, rows, frames_in_scheduler_batch=True)


class WholeCallVideoRunner:
    """Any text-to-video pipeline: one ``pipeline(...)`` call per batch (lists of prompts and
    generators), in one engine step."""

    caches_steps = False     # the pipeline's own loop runs every step

    def __init__(self, pipe):
        self.pipe = pipe

    @torch.inference_mode()
    def advance(self, job: VideoJob) -> None:
        params, tasks = job.params, job.tasks
        kwargs = dict(prompt=[t.params.prompt for t in tasks], num_frames=params.num_frames, width=params.width,
                      height=params.height, num_inference_steps=params.num_inference_steps,
                      guidance_scale=params.guidance_scale,
                      generator=[torch.Generator().manual_seed(t.params.seed) for t in tasks], output_type="np")
        if any(t.params.negative_prompt for t in tasks):
            kwargs["negative_prompt"] = [t.params.negative_prompt for t in tasks]
        videos = self.pipe(**kwargs).frames
        job.frames = [to_uint8(np.asarray(frames)) for frames in videos]
        job.phase = JobPhase.MUX

    def keep_rows(self, job: VideoJob, rows: list[int]) -> None:
        keep_rows(job, rows)


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
        # Nor, in a serving process, with B-frames: the same frames came out as up to 10 different
        # files in 10 encodes (tiny text-to-video frames, an AVX-512 host, PyAV 17 and 18, also with
        # x264's assembly off), and as one file without them, within 0.5 % of the size.
        stream.options = {"crf": "18", "preset": "medium", "x264-params": "bframes=0"}
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
    """Owns the pipeline, the waiting tasks and the running batch. Not thread-safe: the worker's
    loop calls :meth:`add`, :meth:`cancel` and :meth:`step` from one thread."""

    def __init__(self, pipe, *, max_batch_size: int = 1, runner=None, encoder: str | None = None,
                 clock: Callable[[], float] = time.time, step_cache: StepCacheSpec = StepCacheSpec()):
        """``step_cache``: the server's step-caching policy (``--cache-backend``), which a request's
        own ``cache`` replaces; a policy other than ``none`` needs a runner that caches steps."""
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.pipe = pipe
        self.runner = runner or runner_for(pipe)
        if step_cache.enabled and not self.runner.caches_steps:
            raise ValueError(f"--cache-backend {step_cache.backend}: {type(self.runner).__name__} does not cache steps")
        self.step_cache = step_cache
        self.max_batch_size = max_batch_size
        self.encoder = encoder or video_encoder()
        self.clock = clock
        # Wan: sizes in multiples of VAE factor × patch, frames 4k + 1 (omnirelay.dit_families)
        self.family = family_of_pipeline(pipe)
        self.vae_scale_factor = int(pipe.vae_scale_factor_spatial if self.family else pipe.vae_scale_factor)
        self.patch_size = self.family.size_multiple // self.vae_scale_factor if self.family else 1
        self.waiting: RequestQueue[VideoTask] = RequestQueue()
        self.job: VideoJob | None = None
        # batches / batches_of_<n>: the denoising loops run and how many requests each held
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
        return len(self.waiting) + (len(self.job.tasks) if self.job is not None else 0)

    def _running(self, request_id: str) -> bool:
        return self.job is not None and any(t.request_id == request_id for t in self.job.tasks)

    def holds(self, request_id: str) -> bool:
        return self._running(request_id) or any(t.request_id == request_id for t in self.waiting)

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
        cache = task.params.cache
        if cache is not None and cache.enabled and not self.runner.caches_steps:
            raise Unprocessable(f"this pipeline ({type(self.pipe).__name__}) does not serve step caching",
                                param="cache_backend")
        self.waiting.add(task)

    def wake(self) -> None:
        """Nothing to wake: step() never waits idle."""

    def close(self) -> None:
        """Nothing to stop: the engine runs on the step thread; a sequence-parallel group's ranks
        are the role builder's to close (``BuiltRole.owned``)."""

    def cancel(self, request_id: str) -> bool:
        """Forget a request wherever it is; returns whether it was held (unknown ids are ignored).
        The other rows of its batch go on."""
        held = self.holds(request_id)
        if self._running(request_id):
            self.stats["cancelled_running"] += 1
        self._drop(request_id)
        return held

    def _drop(self, request_id: str) -> None:
        self.waiting.remove(request_id)
        job = self.job
        if job is None or not any(t.request_id == request_id for t in job.tasks):
            return
        rows = [i for i, t in enumerate(job.tasks) if t.request_id != request_id]
        if rows:
            self.runner.keep_rows(job, rows)
        else:
            self.job = None

    # ------------------------------------------------------------------ the step

    def step(self) -> StepOutput:
        """One unit of work: admit a batch if none runs, then advance it by one unit."""
        out = StepOutput()
        self._expire(out)
        if self.job is None:
            self.job = self._admit()
            if self.job is None:
                return out
        job = self.job
        phase = job.phase
        if phase is JobPhase.MUX:
            self._mux_one(job, out)
            return out
        if job.step_cache is None:   # a job made outside _admit: the plain loop
            job.step_cache = StepCache(StepCacheSpec(), job.params.num_inference_steps)
        cache = job.step_cache
        computed, skipped = cache.computed, cache.skipped
        try:
            self.runner.advance(job)
        except torch.OutOfMemoryError as exc:
            self._fail_job(job, out, OutOfMemory.error_type, f"out of memory generating video: {exc}")
            return out
        except Exception as exc:   # a bug or a pipeline we cannot drive: fail this batch, keep serving
            log.exception("video batch %s failed in phase %s", [t.request_id for t in job.tasks], phase.value)
            self._fail_job(job, out, OmniError.error_type, f"video generation failed: {type(exc).__name__}: {exc}")
            return out
        self.stats[f"{phase.value}_steps"] += 1
        if cache.enabled:   # branch-steps run and skipped under a step cache (/metrics)
            self.stats["cache_computed_steps"] += cache.computed - computed
            self.stats["cache_skipped_steps"] += cache.skipped - skipped
        job.units_done += 1
        percent = min(99, 100 * job.units_done // job.units_total)
        out.progress.extend(VideoProgress(t.request_id, percent) for t in job.tasks)
        return out

    def _mux_one(self, job: VideoJob, out: StepOutput) -> None:
        """Encode the batch's first row to a file and let it leave the batch."""
        task, frames = job.tasks[0], job.frames[0]
        try:
            data, mime = encode_video(frames, task.params.fps, self.encoder)
        except Exception as exc:   # this request's file only; the other rows are encoded on their own
            log.exception("video %s could not be encoded", task.request_id)
            self._fail(out, task.request_id, OmniError.error_type, f"video encoding failed: {type(exc).__name__}: {exc}")
            return
        self.stats["mux_steps"] += 1
        self.stats["videos_generated"] += 1
        self.stats["frames_generated"] += len(frames)
        self._drop(task.request_id)
        out.videos.append(VideoOutput(task.request_id, data, mime, len(frames)))

    def _admit(self) -> VideoJob | None:
        """The head waiting task plus the next waiting ones of its batch key, up to max_batch_size;
        the others keep their order."""
        tasks = self.waiting.take_batch(self.max_batch_size, lambda task: batch_key(task.params))
        if not tasks:
            return None
        self.stats["batches"] += 1
        self.stats[f"batches_of_{len(tasks)}"] += 1
        params = tasks[0].params
        return VideoJob(tasks, step_cache=StepCache(params.cache or self.step_cache, params.num_inference_steps))

    def _expire(self, out: StepOutput) -> None:
        now = self.clock()
        for task in self.waiting.pop_expired(now):
            self._fail(out, task.request_id, DeadlineExceeded.error_type, "deadline passed while waiting to generate video")
        if self.job is not None:
            for task in [t for t in self.job.tasks if now > t.deadline]:
                self._fail(out, task.request_id, DeadlineExceeded.error_type, "deadline passed while generating video")

    def _fail_job(self, job: VideoJob, out: StepOutput, error_type: str, message: str) -> None:
        self.job = None
        for task in job.tasks:
            self.stats[f"failed_{error_type}"] += 1
            out.failed.append(RequestFailure(task.request_id, error_type, message))

    def _fail(self, out: StepOutput, request_id: str, error_type: str, message: str) -> None:
        self._drop(request_id)
        self.stats[f"failed_{error_type}"] += 1
        out.failed.append(RequestFailure(request_id, error_type, message))

    def load(self) -> dict:
        """Load figures for heartbeats: the videos in the running batch and those waiting."""
        return {"running": len(self.job.tasks) if self.job is not None else 0, "waiting": len(self.waiting)}
