"""The generate role for images, between the bus and :class:`GenerateImageEngine`.

``Task`` in (its ``params`` are an :class:`~omnirelay.image_params.ImageParams`), and out:

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
from omnirelay.errors import PayloadTooLarge
from omnirelay.image_params import ImageParams
from omnirelay.request_params import expect_params

from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.generate.image import GenerateImageEngine, ImageTask, load_pipeline
from omnirelay.workers.generate.assembly import denoiser_dtype, denoising_stats, start_denoiser_ranks
from omnirelay.workers.runtime.assembly import BuiltRole, closed_on_error
from omnirelay.workers.runtime.roles import Outbound, RoleAdapter

log = logging.getLogger("omnirelay.worker.generate")

PNG_MIME = "image/png"
# Room for the other fields and msgpack framing inside one bus message.
MAX_MEDIA_CHARS = p.MAX_BODY_BYTES - 64 * 1024


class GenerateImageRole(RoleAdapter):
    role = "generate"
    engine: GenerateImageEngine

    def accept(self, task: p.Task) -> list[Outbound]:
        self._replace_held(task)
        return self._queue(task, "image request",
                           lambda: ImageTask(task.request_id, expect_params(task.params, ImageParams), task.deadline))

    def step(self) -> list[Outbound]:
        result = self.engine.step()
        out: list[Outbound] = []
        for image in result.images:
            if image.request_id not in self._reply_to:
                continue   # failed earlier in this step (another image was too large)
            data = base64.b64encode(image.png).decode("ascii")
            if len(data) > MAX_MEDIA_CHARS:
                self.engine.cancel(image.request_id)
                out.append(self._engine_failed(image.request_id, PayloadTooLarge.error_type,
                                               f"image {image.index} is {len(image.png)} bytes as PNG; "
                                               f"the limit of one message is {MAX_MEDIA_CHARS * 3 // 4}"))
                continue
            reply_to = self._reply_to[image.request_id]
            out.append((reply_to, p.MediaResult(image.request_id, image.index, PNG_MIME, data,
                                                finish=image.finished, worker_id=self.worker_id)))
            if image.finished:
                del self._reply_to[image.request_id]
                out.append(self._done(image.request_id, None, True))
        out += [self._engine_failed(f.request_id, f.error_type, f.message) for f in result.failed]
        return out


def build_generate_role(config: WorkerConfig, on_fatal: Callable[[str], None] | None = None) -> BuiltRole:
    """A generate worker for a diffusers text-to-image pipeline directory (``config.model_path``);
    ``config.capacity`` (by default the stage's ``runtime.max_batch_size``, 1 for diffusion) bounds
    both the requests held and the images denoised together. Runs on the first CUDA device when
    there is one, except with ``config.sequence_parallel_size`` > 1: then the transformer runs over
    that many ranks (this process and the ones it starts, gloo on the CPU), which the engine's
    ``close`` stops (the runtime closes the engine); ``on_fatal(reason)`` is called once, from any thread, if
    that group loses a rank (the worker should then stop taking work and exit non-zero)."""
    device, group = start_denoiser_ranks(config, on_fatal)
    with closed_on_error(group):
        pipe = load_pipeline(config.model_path, getattr(torch, config.dtype), device)
        if group is not None:
            group.attach(pipe.transformer)
            log.info("generate worker: transformer runs over %d sequence-parallel ranks", group.size)
        engine = GenerateImageEngine(pipe, max_batch_size=config.capacity, sequence_parallel=group)
    weights = denoiser_dtype(engine.pipe)
    log.info("generate worker: %s (%s, runner %s) on %s, denoiser weights %s, batch up to %d, native size %dx%d",
             config.model_path, type(engine.pipe).__name__, type(engine.runner).__name__, device, weights,
             config.capacity, engine.default_width, engine.default_height)
    return BuiltRole(GenerateImageRole(config.worker_id, engine),
                     denoising_stats(engine, group, weights, config.sequence_parallel_size), owned=())
