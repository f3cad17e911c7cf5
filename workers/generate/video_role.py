"""The generate role for video, between the bus and :class:`GenerateVideoEngine`.

``Task`` in (its ``params`` are a :class:`~omnirelay.video_params.VideoParams`), and out,
straight to the gateway's ``reply_to``:

* a progress :class:`~omnirelay.broker.protocol.MediaResult` (``PROGRESS_MIME``, index -1, the
  percent as text) after each unit of work, only when the percentage moved;
* the finished file as base64 in chunks of at most ``MAX_CHUNK_CHARS`` characters, one
  ``MediaResult`` each (index = chunk number, ``finish`` on the last), so a video larger than one
  bus message arrives whole instead of failing;
* then ``StageDone(finished=True)`` to the broker — after the last chunk, so the broker never
  forgets a request whose bytes are still on their way;
* or one ``StageFailed`` (``bad_request`` for parameters the model cannot honour,
  ``deadline_exceeded``, ``out_of_memory``, ``payload_too_large`` for a file over
  ``MAX_VIDEO_BYTES``, ``worker_lost`` once a sequence-parallel group lost a rank — the broker
  retries it elsewhere, and this worker exits).

A ``CancelTask`` reaches :meth:`cancel`, which drops the job between two denoising steps.
Same interface as the adapters in ``roles.py``; the runtime treats it alike.
"""

from __future__ import annotations

import base64
import logging
from typing import Callable

import torch

from omnirelay.broker import protocol as p
from omnirelay.errors import OmniError, PayloadTooLarge, WorkerLost
from omnirelay.video_params import MAX_CHUNK_CHARS, MAX_VIDEO_BYTES, PROGRESS_INDEX, PROGRESS_MIME, VideoParams
from omnirelay.request_params import expect_params
from omnirelay.step_cache_params import parse_flag

from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.generate.image import load_pipeline
from omnirelay.workers.generate.assembly import denoiser_dtype, denoising_stats, start_denoiser_ranks
from omnirelay.workers.generate.sequence_parallel_group import SequenceParallelDenoiser
from omnirelay.workers.generate.video import GenerateVideoEngine, VideoTask
from omnirelay.workers.runtime.assembly import BuiltRole, closed_on_error
from omnirelay.workers.runtime.roles import Outbound, RoleAdapter

log = logging.getLogger("omnirelay.worker.generate")


class GenerateVideoRole(RoleAdapter):
    role = "generate"

    def __init__(self, worker_id: str, engine: GenerateVideoEngine, *, chunk_chars: int = MAX_CHUNK_CHARS,
                 max_video_bytes: int = MAX_VIDEO_BYTES, sequence_parallel: SequenceParallelDenoiser | None = None):
        """``sequence_parallel``: the group installed on the engine's transformers, if any; once it
        is lost, what this role held or is sent fails as ``worker_lost``."""
        super().__init__(worker_id, engine)
        self.sequence_parallel = sequence_parallel
        if chunk_chars < 4 or chunk_chars % 4 or chunk_chars > MAX_CHUNK_CHARS:
            raise ValueError(f"chunk_chars must be a positive multiple of 4 up to {MAX_CHUNK_CHARS}")
        self.chunk_chars = chunk_chars
        self.max_video_bytes = max_video_bytes
        self._progress: dict[str, int] = {}   # request → the last percentage sent (none sent yet: 0)

    def accept(self, task: p.Task) -> list[Outbound]:
        self._replace_held(task)
        lost = self._group_lost()
        if lost:
            return [self.failure(task.request_id, task.stage, WorkerLost.error_type, lost, attempt=task.attempt)]
        return self._queue(task, "video request",
                           lambda: VideoTask(task.request_id, expect_params(task.params, VideoParams), task.deadline))

    def cancel(self, request_id: str) -> None:
        if super().cancel(request_id):
            log.info("video request %s cancelled", request_id)

    def _forget(self, request_id: str) -> None:
        super()._forget(request_id)
        self._progress.pop(request_id, None)

    def step(self) -> list[Outbound]:
        result = self.engine.step()
        out: list[Outbound] = []
        for update in result.progress:
            reply_to = self._reply_to.get(update.request_id)
            if reply_to is not None and update.percent > self._progress.get(update.request_id, 0):
                self._progress[update.request_id] = update.percent
                out.append((reply_to, p.MediaResult(update.request_id, PROGRESS_INDEX, PROGRESS_MIME,
                                                    str(update.percent), worker_id=self.worker_id)))
        for video in result.videos:
            reply_to = self._reply_to.get(video.request_id)
            if reply_to is None:
                continue
            self._forget(video.request_id)
            if len(video.data) > self.max_video_bytes:
                out.append(self.failure(video.request_id, self.role, PayloadTooLarge.error_type,
                                        f"the video is {len(video.data)} bytes; this worker sends at most "
                                        f"{self.max_video_bytes}"))
                continue
            out.extend((reply_to, chunk) for chunk in self.chunks(video.request_id, video.data, video.mime))
            out.append(self._done(video.request_id, None, True))
        lost = self._group_lost()
        for failure in result.failed:
            # A job whose forward met the lost group failed inside the engine; another worker may run it.
            error_type = WorkerLost.error_type if lost and failure.error_type == OmniError.error_type else failure.error_type
            out.append(self._engine_failed(failure.request_id, error_type, failure.message))
        return out

    def _group_lost(self) -> str:
        """Why this worker's sequence-parallel group is lost ('' while it can run, or without one)."""
        lost = self.sequence_parallel.lost if self.sequence_parallel is not None else None
        return f"this worker's sequence-parallel group is lost ({lost}); the worker restarts" if lost else ""

    def chunks(self, request_id: str, data: bytes, mime: str) -> list[p.MediaResult]:
        """The file as base64 chunk messages, each under one bus message's limit."""
        encoded = base64.b64encode(data).decode("ascii")
        pieces = [encoded[i:i + self.chunk_chars] for i in range(0, len(encoded), self.chunk_chars)] or [""]
        return [p.MediaResult(request_id, k, mime, piece, finish=k == len(pieces) - 1, worker_id=self.worker_id)
                for k, piece in enumerate(pieces)]


def build_generate_video_role(config: WorkerConfig, on_fatal: Callable[[str], None] | None = None) -> BuiltRole:
    """A generate worker for a diffusers text-to-video pipeline directory (``config.model_path``),
    loaded in ``config.dtype``. ``config.capacity`` (by default the stage's ``runtime.max_batch_size``,
    1 for diffusion) bounds both the requests held and the videos of one shape denoised together.
    Runs on the first CUDA device when there is one, except with ``config.sequence_parallel_size`` > 1
    (Wan): then its transformers run over that many ranks (this process and the ones it starts, gloo
    on the CPU), which closing the group (owned) stops; ``on_fatal(reason)`` is called once, from any
    thread, if that group loses a rank (the worker should then stop taking work and exit)."""
    device, group = start_denoiser_ranks(config, on_fatal)
    with closed_on_error(group):
        pipe = load_pipeline(config.model_path, getattr(torch, config.dtype), device)
        if group is not None:
            group.attach(*group.experts_of(pipe))
            log.info("generate worker (video): transformers run over %d sequence-parallel ranks", group.size)
        engine = GenerateVideoEngine(pipe, max_batch_size=config.capacity,
                                     step_cache=parse_flag(config.cache_backend, config.cache_config))
    weights = denoiser_dtype(engine.pipe)
    log.info("generate worker (video): %s (%s, runner %s) on %s, denoiser weights %s, encoder %s, batch up to %d, "
             "step cache %s", config.model_path, type(engine.pipe).__name__, type(engine.runner).__name__, device,
             weights, engine.encoder, config.capacity, engine.step_cache)
    return BuiltRole(GenerateVideoRole(config.worker_id, engine, sequence_parallel=group),
                     denoising_stats(engine, group, weights, config.sequence_parallel_size),
                     owned=(group,) if group is not None else ())
