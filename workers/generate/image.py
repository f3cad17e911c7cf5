"""The generate role for images: a diffusers text-to-image pipeline behind a pure ``step()`` engine.

Life of a request through the engine::

    add(ImageTask) ──▶ waiting: one ImageItem per image (a request with n images is n items, FIFO)
        ──admit: the head item plus up to max_batch_size-1 waiting items with the same batch key
          (width, height, steps, guidance on/off)──▶ running Batch
    Batch.phase: ENCODE (prompt embeddings, seeded latents, timesteps)
             ──▶ DENOISE (one scheduler step per engine step)
             ──▶ DECODE (VAE → pixels → PNG bytes) ──▶ ImageOutput per item, in index order;
                 the request's last image carries ``finished``

One call of :meth:`GenerateImageEngine.step` does one unit of that work — encode, one denoising
step or decode — so the worker's loop between calls can take new tasks, cancel requests and keep
heartbeating even while a long generation runs. A cancelled request leaves the running batch at
the next step (its rows are cut out of the latents); a request past its deadline fails with
``deadline_exceeded``; a failure of one image fails its whole request.

Determinism: image ``k`` of a request starts from latents drawn from its own CPU
``torch.Generator`` seeded with ``seed + k``, so the same seed gives the same image whatever else
shares its batch and on whichever worker it is retried (bit-exact for batch size 1; other batch
compositions can differ by float rounding). With batch size 1 the result equals
``pipeline(prompt, generator=torch.Generator().manual_seed(seed), ...)``.

Runners: Stable Diffusion pipelines (:class:`StableDiffusionPipeline` — a UNet, a VAE, a scheduler
and a CLIP text encoder) are driven step by step (:class:`StepwiseRunner`), and so is
``ZImagePipeline`` (Z-Image-Turbo: :class:`~.zimage.StepwiseZImageRunner`, equal to its ``__call__``
for the same seeds); its few-step default, its size multiple (VAE factor × patch) and its native
size come from the family table (:mod:`omnirelay.dit_families`), which the gateway reads too. Any
other diffusers text-to-image pipeline runs through its own ``__call__`` in one engine step
(:class:`WholeCallRunner`, a list of prompts with one generator per image); the worker then does not
heartbeat for the length of one batch, so a slow pipeline needs a broker liveness longer than a
generation.

Edits (``POST /v1/images/edits``): an item with an input image runs through
:class:`~omnirelay.workers.generate.image_edit.EditRunner`, the same components as diffusers' image-to-image
or (with a mask) inpainting pipeline; a batch holds edits or generations, never both.

Sequence parallelism (``--sequence-parallel-size N``, a diffusion-transformer pipeline such as SD3):
the pipeline's transformer runs over N ranks (:mod:`.sequence_parallel_group`); the runner is the
same — the pipeline's own loop drives the group — and :meth:`GenerateImageEngine.add` refuses sizes
whose image tokens do not split over N. Once the group is lost (a rank died), every request the
engine holds fails with ``worker_lost`` — another worker may serve it — and so does every later one;
the worker (told through the group's ``on_lost``) stops taking work and exits to be restarted.

No sockets here; the role adapter (``generate_role.py``) turns outputs into bus messages.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import importlib.util
import io
import itertools
import logging
import time
from typing import Callable

import torch

from omnirelay.dit_families import family_of_pipeline
from omnirelay.errors import BadRequest, DeadlineExceeded, OmniError, OutOfMemory, WorkerLost
from omnirelay.image_params import ImageParams

from omnirelay.workers.generate.image_edit import EditRunner
from omnirelay.workers.generate.sequence_parallel_group import SequenceParallelGroupLost
from omnirelay.workers.runtime.engine import RequestFailure
from omnirelay.workers.runtime.request_queue import RequestQueue

log = logging.getLogger("omnirelay.worker.generate")

DEFAULT_STEPS = 50          # diffusers' default, so an unparameterised request equals pipeline(prompt)


@dataclasses.dataclass(frozen=True)
class ImageTask:
    """One request: ``deadline`` is wall-clock seconds since the epoch (as on the bus)."""

    request_id: str
    params: ImageParams
    deadline: float


@dataclasses.dataclass(frozen=True)
class ImageItem:
    """One image of a request, with everything resolved (defaults applied)."""

    request_id: str
    index: int
    prompt: str
    negative_prompt: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    image: str = ""            # an edit: the input image (base64 PNG at width × height)
    mask: str = ""             # … and its mask (white: repaint)
    strength: float = 0.0      # … how far the input is noised (0: the pipeline's default)


@dataclasses.dataclass(frozen=True)
class ImageOutput:
    request_id: str
    index: int
    png: bytes
    finished: bool            # the request's last image


@dataclasses.dataclass
class StepOutput:
    images: list[ImageOutput] = dataclasses.field(default_factory=list)
    failed: list[RequestFailure] = dataclasses.field(default_factory=list)


class BatchPhase(enum.Enum):
    ENCODE = "encode"
    DENOISE = "denoise"
    DECODE = "decode"


@dataclasses.dataclass
class Batch:
    """Images that denoise together. The tensors belong to :class:`StepwiseRunner` (row ``i`` of
    each is ``items[i]``); :class:`WholeCallRunner` only uses ``items``."""

    items: list[ImageItem]
    phase: BatchPhase = BatchPhase.ENCODE
    latents: torch.Tensor | None = None
    prompt_embeds: torch.Tensor | None = None
    negative_embeds: torch.Tensor | None = None
    guidance: torch.Tensor | None = None
    generators: list[torch.Generator] = dataclasses.field(default_factory=list)
    scheduler: object = None
    step_index: int = 0
    runner: object = None               # the runner that advances it (edits have their own)

    @property
    def guided(self) -> bool:
        return self.items[0].guidance_scale > 1.0


@dataclasses.dataclass
class _RequestState:
    task: ImageTask
    remaining: int


# ---------------------------------------------------------------------------------------- runners


class StepwiseRunner:
    """Drives a Stable Diffusion pipeline one phase or one denoising step per call, reproducing
    ``StableDiffusionPipeline.__call__`` (no IP-adapter, no guidance rescale, eta 0) with a guidance
    scale per row."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.device = pipe.unet.device

    def batch_key(self, item: ImageItem) -> tuple:
        return item.width, item.height, item.steps, item.guidance_scale > 1.0

    @torch.inference_mode()
    def advance(self, batch: Batch) -> list | None:
        """Do the batch's next unit of work; return the PIL images once decoded, else None."""
        pipe = self.pipe
        if batch.phase is BatchPhase.ENCODE:
            items = batch.items
            positive, negative = pipe.encode_prompt(
                [it.prompt for it in items], self.device, 1, batch.guided, [it.negative_prompt for it in items])
            batch.prompt_embeds, batch.negative_embeds = positive, negative
            batch.generators = [torch.Generator().manual_seed(it.seed) for it in items]
            batch.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
            batch.scheduler.set_timesteps(items[0].steps, device=self.device)
            batch.latents = pipe.prepare_latents(len(items), pipe.unet.config.in_channels, items[0].height,
                                                 items[0].width, positive.dtype, self.device, batch.generators)
            batch.guidance = torch.tensor([it.guidance_scale for it in items], dtype=positive.dtype,
                                          device=self.device).view(-1, 1, 1, 1)
            batch.phase = BatchPhase.DENOISE
            return None
        if batch.phase is BatchPhase.DENOISE:
            scheduler = batch.scheduler
            t = scheduler.timesteps[batch.step_index]
            latents = batch.latents
            model_input = torch.cat([latents] * 2) if batch.guided else latents
            model_input = scheduler.scale_model_input(model_input, t)
            embeds = torch.cat([batch.negative_embeds, batch.prompt_embeds]) if batch.guided else batch.prompt_embeds
            noise = pipe.unet(model_input, t, encoder_hidden_states=embeds, return_dict=False)[0]
            if batch.guided:
                uncond, text = noise.chunk(2)
                noise = uncond + batch.guidance * (text - uncond)
            extra = pipe.prepare_extra_step_kwargs(batch.generators, 0.0)
            batch.latents = scheduler.step(noise, t, latents, **extra, return_dict=False)[0]
            batch.step_index += 1
            if batch.step_index >= len(scheduler.timesteps):
                batch.phase = BatchPhase.DECODE
            return None
        pixels = pipe.vae.decode(batch.latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
        return pipe.image_processor.postprocess(pixels, output_type="pil", do_denormalize=[True] * len(pixels))

    def keep_rows(self, batch: Batch, rows: list[int]) -> None:
        """Cut the rows of cancelled items out of a batch in flight."""
        batch.items = [batch.items[i] for i in rows]
        batch.generators = [batch.generators[i] for i in rows] if batch.generators else []
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for name in ("latents", "prompt_embeds", "negative_embeds", "guidance"):
            tensor = getattr(batch, name)
            if tensor is not None:
                setattr(batch, name, tensor.index_select(0, index))


class WholeCallRunner:
    """Any text-to-image pipeline: one ``pipeline(...)`` call per batch, in one engine step."""

    def __init__(self, pipe):
        self.pipe = pipe

    def batch_key(self, item: ImageItem) -> tuple:
        return item.width, item.height, item.steps, item.guidance_scale

    @torch.inference_mode()
    def advance(self, batch: Batch) -> list:
        items = batch.items
        kwargs = dict(prompt=[it.prompt for it in items], width=items[0].width, height=items[0].height,
                      num_inference_steps=items[0].steps, guidance_scale=items[0].guidance_scale,
                      generator=[torch.Generator().manual_seed(it.seed) for it in items], output_type="pil")
        if any(it.negative_prompt for it in items):
            kwargs["negative_prompt"] = [it.negative_prompt for it in items]
        return list(self.pipe(**kwargs).images)

    def keep_rows(self, batch: Batch, rows: list[int]) -> None:
        batch.items = [batch.items[i] for i in rows]


# ---------------------------------------------------------------------------------------- engine


def load_pipeline(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """A diffusers pipeline from a local directory (never the network)."""
    from diffusers import DiffusionPipeline
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()      # per-load bars are noise in a daemon's log
    transformers_logging.disable_progress_bar()
    # diffusers loads float32 unless told otherwise; naming another dtype keeps the modules a
    # pipeline pins to float32 there. Without accelerate, ask for the plain loader instead of a warning.
    kwargs = {} if dtype == torch.float32 else {"torch_dtype": dtype}
    accelerate = importlib.util.find_spec("accelerate") is not None
    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True, low_cpu_mem_usage=accelerate, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    if not accelerate:   # accelerate's loader casts each tensor as it loads it
        _cast_unpinned_models(pipe, dtype)
    return pipe.to(device)


def _cast_unpinned_models(pipe, dtype: torch.dtype) -> None:
    """Put every diffusers model of ``pipe`` that pins nothing to float32 in ``dtype``.

    Why: diffusers' plain loader (no accelerate) builds the model in ``dtype`` and then either
    copies the file's tensors into it or, when the first entry of the model's state dict already
    has the file's dtype, *assigns* the file's tensors in place of the model's. SD3's transformer
    starts with its float32 position table (``pos_embed.pos_embed``, a buffer built in float32), so
    it takes the assigning path and ends up float32 while the VAE and text encoders are in
    ``dtype``; its first forward then fails on mismatched dtypes. A model that declares
    ``_keep_in_fp32_modules`` is left as loaded: casting it whole would undo those pins.
    (``nn.Module.to`` rather than diffusers' override, which warns about pins on every dtype cast,
    even for a model that declares none.)"""
    from diffusers import ModelMixin

    for name, module in pipe.components.items():
        if not isinstance(module, ModelMixin) or module._keep_in_fp32_modules:
            continue
        found = {t.dtype for t in itertools.chain(module.parameters(), module.buffers()) if t.is_floating_point()}
        if found - {dtype}:
            log.info("pipeline component %s loaded as %s; casting it to %s", name,
                     ", ".join(sorted(map(str, found))), dtype)
            torch.nn.Module.to(module, dtype)


def runner_for(pipe):
    """The stepwise runner of a pipeline we can drive step by step (Stable Diffusion, Z-Image), else
    the whole-call one."""
    from diffusers import StableDiffusionPipeline, ZImagePipeline

    if isinstance(pipe, StableDiffusionPipeline) and pipe.unet.config.time_cond_proj_dim is None:
        return StepwiseRunner(pipe)
    if isinstance(pipe, ZImagePipeline):
        from omnirelay.workers.generate.zimage import StepwiseZImageRunner   # imports this module's batch types
        return StepwiseZImageRunner(pipe)
    return WholeCallRunner(pipe)


class GenerateImageEngine:
    """Owns the pipeline, the waiting items and the running batch. Not thread-safe: the worker's
    loop calls :meth:`add`, :meth:`cancel` and :meth:`step` from one thread."""

    def __init__(self, pipe, *, max_batch_size: int = 1, runner=None,
                 clock: Callable[[], float] = time.time, sequence_parallel=None):
        """``sequence_parallel``: the :class:`~omnirelay.workers.generate.sequence_parallel_group.SequenceParallelDenoiser`
        installed on ``pipe``'s transformer, if any; the engine refuses sizes it cannot split and
        :meth:`close` stops its ranks."""
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.pipe = pipe
        self.runner = runner or runner_for(pipe)
        self.max_batch_size = max_batch_size
        self.clock = clock
        self.sequence_parallel = sequence_parallel
        self.vae_scale_factor = int(pipe.vae_scale_factor)
        # A transformer denoiser cuts the latent into patch × patch tiles, so sizes go in multiples of both.
        denoiser = pipe.components.get("unet") or pipe.components.get("transformer")
        self.patch_size = int(denoiser.config.get("patch_size", 1)) if denoiser is not None else 1
        # SD3-style transformers crop a fixed table of positions: larger images fail inside the denoiser.
        max_patches = denoiser.config.get("pos_embed_max_size") if denoiser is not None else None
        self.max_side = max_patches * self.patch_size * self.vae_scale_factor if max_patches else None
        self.default_width, self.default_height = _native_size(pipe, self.vae_scale_factor)
        self.default_steps = DEFAULT_STEPS
        family = family_of_pipeline(pipe)   # Z-Image: its own patching, native size and step count
        if family is not None:
            self.patch_size = family.size_multiple // self.vae_scale_factor
            self.default_width, self.default_height = family.native_size
            self.default_steps = family.default_steps
        self.waiting: RequestQueue[ImageItem] = RequestQueue()
        self.batch: Batch | None = None
        self.requests: dict[str, _RequestState] = {}
        self.stats: collections.Counter[str] = collections.Counter()
        self._edit_runner: EditRunner | None = None   # built on the first edit

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                        **kwargs) -> "GenerateImageEngine":
        return cls(load_pipeline(path, dtype, device), **kwargs)

    # ------------------------------------------------------------------ queue side

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.batch is not None

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def add(self, task: ImageTask) -> None:
        """Queue a request's images. Raises :class:`BadRequest` for a size this model cannot make
        and ValueError for a duplicate request id or a missing seed."""
        params = task.params
        if task.request_id in self.requests:
            raise ValueError(f"request {task.request_id} is already held")
        if params.seed is None:
            raise ValueError("image requests carry a seed (the gateway picks one)")
        width = params.width or self.default_width
        height = params.height or self.default_height
        multiple = self.vae_scale_factor * self.patch_size
        if width % multiple or height % multiple:
            raise BadRequest(f"this model makes images in multiples of {multiple} pixels, got {width}x{height}",
                             param="size")
        if self.max_side and max(width, height) > self.max_side:
            raise BadRequest(f"this model makes images of at most {self.max_side} pixels a side, got "
                             f"{width}x{height}", param="size")
        if self.sequence_parallel is not None:
            self.sequence_parallel.check_size(width, height, self.vae_scale_factor)
        steps = params.num_inference_steps or self.default_steps
        if params.image:
            if self._edit_runner is None:
                self._edit_runner = EditRunner(self.pipe)   # BadRequest: this pipeline cannot edit
            if self.sequence_parallel is not None:
                raise BadRequest("image edits are not served by a sequence-parallel worker", param="model")
        self.requests[task.request_id] = _RequestState(task, remaining=params.n)
        for index in range(params.n):
            self.waiting.add(ImageItem(task.request_id, index, params.prompt, params.negative_prompt, width,
                                          height, steps, params.guidance_scale, params.image_seed(index),
                                          params.image, params.mask, params.strength))

    def cancel(self, request_id: str) -> None:
        """Forget a request wherever it is; unknown ids are ignored."""
        if self.requests.pop(request_id, None) is None:
            return
        self._drop_items(request_id)

    def _drop_items(self, request_id: str) -> None:
        self.waiting.remove_all(request_id)
        batch = self.batch
        if batch is not None and any(it.request_id == request_id for it in batch.items):
            rows = [i for i, it in enumerate(batch.items) if it.request_id != request_id]
            if rows:
                batch.runner.keep_rows(batch, rows)
            else:
                self.batch = None

    # ------------------------------------------------------------------ the step

    def step(self) -> StepOutput:
        """One unit of work: admit a batch if none runs, then advance it one phase or step."""
        out = StepOutput()
        self._expire(out)
        lost = self.sequence_parallel.lost if self.sequence_parallel is not None else None
        if lost:
            self._fail_all(out, f"this worker's sequence-parallel group is lost ({lost}); the worker restarts")
            return out
        if self.batch is None:
            self.batch = self._admit()
            if self.batch is None:
                return out
        batch = self.batch
        phase = batch.phase
        try:
            images = batch.runner.advance(batch)
        except torch.OutOfMemoryError as exc:
            self._fail_batch(batch, out, OutOfMemory.error_type, f"out of memory generating images: {exc}")
            return out
        except SequenceParallelGroupLost as exc:   # nothing here can run again: fail all we hold, recoverably
            self._fail_all(out, f"{exc}; the worker restarts")
            return out
        except Exception as exc:   # a bug or a pipeline we cannot drive: fail these requests, keep serving
            log.exception("image batch failed")
            self._fail_batch(batch, out, OmniError.error_type, f"image generation failed: {type(exc).__name__}: {exc}")
            return out
        self.stats[f"{phase.value}_steps"] += 1
        if images is None:
            return out
        self.batch = None
        self.stats["batches"] += 1
        for item, image in zip(batch.items, images):
            state = self.requests.get(item.request_id)
            if state is None:
                continue
            state.remaining -= 1
            if not state.remaining:
                del self.requests[item.request_id]
            self.stats["images_generated"] += 1
            out.images.append(ImageOutput(item.request_id, item.index, encode_png(image), not state.remaining))
        return out

    def _admit(self) -> Batch | None:
        items = self.waiting.take_batch(self.max_batch_size, self._batch_key)
        return Batch(items, runner=self._runner(items[0])) if items else None

    def _batch_key(self, item: ImageItem) -> tuple:
        """Items of one key run in one batch: the same runner (generation or edit) and shape."""
        runner = self._runner(item)
        return id(runner), runner.batch_key(item)

    def _runner(self, item: ImageItem):
        return self._edit_runner if item.image else self.runner

    def _expire(self, out: StepOutput) -> None:
        now = self.clock()
        for request_id in [rid for rid, st in self.requests.items() if now > st.task.deadline]:
            self._fail_request(request_id, out, DeadlineExceeded.error_type, "deadline passed while generating images")

    def _fail_batch(self, batch: Batch, out: StepOutput, error_type: str, message: str) -> None:
        self.batch = None
        for request_id in dict.fromkeys(it.request_id for it in batch.items):
            self._fail_request(request_id, out, error_type, message)

    def _fail_all(self, out: StepOutput, message: str) -> None:
        """Fail every request held as ``worker_lost``: this worker cannot run them, another may."""
        if self.requests:
            log.error("failing %d held request(s) as worker_lost: %s", len(self.requests), message)
        self.batch = None
        for request_id in list(self.requests):
            self._fail_request(request_id, out, WorkerLost.error_type, message)

    def _fail_request(self, request_id: str, out: StepOutput, error_type: str, message: str) -> None:
        if self.requests.pop(request_id, None) is None:
            return
        self._drop_items(request_id)
        self.stats[f"failed_{error_type}"] += 1
        out.failed.append(RequestFailure(request_id, error_type, message))

    def load(self) -> dict:
        """Load figures for heartbeats: images in the running batch and waiting."""
        return {"running": len(self.batch.items) if self.batch else 0, "waiting": len(self.waiting)}

    def wake(self) -> None:
        """Nothing to wake: step() never waits idle."""

    def close(self) -> None:
        """Stop what the engine owns beyond this process (a sequence-parallel group's ranks)."""
        if self.sequence_parallel is not None:
            self.sequence_parallel.close()


def _native_size(pipe, scale: int) -> tuple[int, int]:
    """The pipeline's default resolution: its denoiser's sample size times the VAE factor."""
    denoiser = pipe.components.get("unet") or pipe.components.get("transformer")
    size = denoiser.config.get("sample_size", 64) if denoiser is not None else 64
    if isinstance(size, int):
        return size * scale, size * scale
    height, width = size
    return width * scale, height * scale


def encode_png(image) -> bytes:
    """PNG bytes of a PIL image (lossless and deterministic: same pixels, same bytes)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
