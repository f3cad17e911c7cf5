"""The generate role for images, between the bus and :class:`GenerateImageEngine`.

``Task`` in (its ``sampling`` map is an :class:`~omnirelay.image_params.ImageParams`), and out:

* one :class:`~omnirelay.broker.protocol.MediaResult` per image, straight to the gateway's
  ``reply_to`` as soon as it is decoded (base64 PNG; the last one has ``finish``);
* then ``StageDone(finished=True)`` to the broker — after the last image, so the broker never
  forgets a request whose images are still on their way;
* or one ``StageFailed`` (``bad_request`` for parameters the model cannot honour, ``deadline_exceeded``,
  ``out_of_memory``, ``payload_too_large`` for an image too big for one bus message, ``worker_lost``
  once a sequence-parallel group lost a rank — the broker retries it elsewhere, and this worker exits).

Same interface as the adapters in ``roles.py``; the runtime treats it alike.
"""

from __future__ import annotations

import base64
import logging
from typing import Callable

import torch

from omnirelay.broker import protocol as p
from omnirelay.errors import BadRequest, PayloadTooLarge
from omnirelay.image_params import ImageParams

from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.generate.image import GenerateImageEngine, ImageTask, load_pipeline
from omnirelay.workers.runtime.roles import Outbound, RoleAdapter
from omnirelay.workers.generate.sequence_parallel_group import SequenceParallelDenoiser

log = logging.getLogger("omnirelay.worker.generate")

PNG_MIME = "image/png"
# Room for the other fields and msgpack framing inside one bus message.
MAX_MEDIA_CHARS = p.MAX_BODY_BYTES - 64 * 1024


class GenerateImageRole(RoleAdapter):
    role = "generate"

    def __init__(self, worker_id: str, engine: GenerateImageEngine):
        super().__init__(worker_id)
        self.engine = engine
        self._reply_to: dict[str, str] = {}

    def accept(self, task: p.Task) -> list[Outbound]:
        if task.request_id in self._reply_to:
            self.cancel(task.request_id)   # the broker re-dispatched a request we still hold: the new attempt wins
        try:
            params = ImageParams.from_wire(task.sampling)
            self.engine.add(ImageTask(task.request_id, params, task.deadline))
        except BadRequest as exc:
            return [self.failure(task.request_id, task.stage, BadRequest.error_type, f"invalid image request: {exc.message}",
                                 attempt=task.attempt)]
        except (TypeError, ValueError) as exc:
            return [self.failure(task.request_id, task.stage, BadRequest.error_type, f"invalid image request: {exc}",
                                 attempt=task.attempt)]
        self._reply_to[task.request_id] = task.reply_to
        self._attempts[task.request_id] = task.attempt
        return []

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)
        self._reply_to.pop(request_id, None)
        self._attempts.pop(request_id, None)

    def step(self) -> list[Outbound]:
        result = self.engine.step()
        out: list[Outbound] = []
        for image in result.images:
            if image.request_id not in self._reply_to:
                continue   # failed earlier in this step (another image was too large)
            data = base64.b64encode(image.png).decode("ascii")
            if len(data) > MAX_MEDIA_CHARS:
                self.engine.cancel(image.request_id)
                self._reply_to.pop(image.request_id, None)
                out.append(self.failure(image.request_id, self.role, PayloadTooLarge.error_type,
                                        f"image {image.index} is {len(image.png)} bytes as PNG; "
                                        f"the limit of one message is {MAX_MEDIA_CHARS * 3 // 4}"))
                continue
            reply_to = self._reply_to[image.request_id]
            out.append((reply_to, p.MediaResult(image.request_id, image.index, PNG_MIME, data,
                                                finish=image.finished, worker_id=self.worker_id)))
            if image.finished:
                del self._reply_to[image.request_id]
                out.append(self._done(image.request_id, None, True))
        for failure in result.failed:
            self._reply_to.pop(failure.request_id, None)
            out.append(self.failure(failure.request_id, self.role, failure.error_type, failure.message))
        return out


def build_generate_role(config: WorkerConfig, on_lost: Callable[[str], None] | None = None
                        ) -> tuple[GenerateImageRole, Callable[[], dict]]:
    """The role adapter and heartbeat-stats function for a generate worker. ``config.model_path``
    is a diffusers pipeline directory; ``config.capacity`` (by default the stage's
    ``runtime.max_batch_size``, 1 for diffusion) bounds both the requests held and the images
    denoised together. Runs on the first CUDA device when there is one, except with
    ``config.sequence_parallel_size`` > 1: then the transformer runs over that many ranks (this
    process and the ones it starts, gloo on the CPU), which the engine's ``close`` stops;
    ``on_lost(reason)`` is called once, from any thread, if that group loses a rank (the worker
    should then stop taking work and exit non-zero)."""
    sp_size = config.sequence_parallel_size
    # The SP group's collectives are gloo on the CPU (as the TP/PP group's): rank 0 stays there too.
    device = "cuda" if torch.cuda.is_available() and sp_size == 1 else "cpu"
    # Ranks 1..N-1 start first: they load their transformer while this process loads the pipeline.
    sequence_parallel = (SequenceParallelDenoiser(config.model_path, sp_size, config.threads, on_lost=on_lost)
                         if sp_size > 1 else None)
    try:
        pipe = load_pipeline(config.model_path, getattr(torch, config.dtype), device)
        if sequence_parallel is not None:
            sequence_parallel.attach(pipe.transformer)
            log.info("generate worker: transformer runs over %d sequence-parallel ranks", sp_size)
        engine = GenerateImageEngine(pipe, max_batch_size=config.capacity, sequence_parallel=sequence_parallel)
    except BaseException:
        if sequence_parallel is not None:
            sequence_parallel.close()
        raise
    # The dtype the denoiser really holds (what --dtype asked for, unless the pipeline pins it):
    # logged and heartbeated, so a deployment can see that its --dtype took effect.
    denoiser = engine.pipe.components.get("unet") or engine.pipe.components.get("transformer")
    weights = next(denoiser.parameters())
    log.info("generate worker: %s (%s, runner %s) on %s, denoiser weights %s, batch up to %d, native size %dx%d",
             config.model_path, type(engine.pipe).__name__, type(engine.runner).__name__, device, weights.dtype,
             config.capacity, engine.default_width, engine.default_height)
    weight_bits = weights.element_size() * 8

    def stats() -> dict:
        sp = sequence_parallel.stats if sequence_parallel is not None else {}
        return {**engine.load(), **engine.stats, **sp, "denoiser_weight_bits": weight_bits,
                "sequence_parallel_size": sp_size}

    return GenerateImageRole(config.worker_id, engine), stats
