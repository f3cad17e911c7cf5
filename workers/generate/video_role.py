"""The generate role for video, between the bus and :class:`GenerateVideoEngine`.

``Task`` in (its ``sampling`` map is a :class:`~omnirelay.video_params.VideoParams`), and out,
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
from omnirelay.errors import BadRequest, OmniError, PayloadTooLarge, WorkerLost
from omnirelay.video_params import MAX_CHUNK_CHARS, MAX_VIDEO_BYTES, PROGRESS_INDEX, PROGRESS_MIME, VideoParams

from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.generate.image import load_pipeline
from omnirelay.workers.generate.sequence_parallel_group import SequenceParallelDenoiser
from omnirelay.workers.generate.video import GenerateVideoEngine, VideoTask
from omnirelay.workers.runtime.roles import Outbound, RoleAdapter

log = logging.getLogger("omnirelay.worker.generate")


class GenerateVideoRole(RoleAdapter):
    role = "generate"

    def __init__(self, worker_id: str, engine: GenerateVideoEngine, *, chunk_chars: int = MAX_CHUNK_CHARS,
                 max_video_bytes: int = MAX_VIDEO_BYTES, sequence_parallel: SequenceParallelDenoiser | None = None):
        """``sequence_parallel``: the group installed on the engine's transformers, if any; once it
        is lost, what this role held or is sent fails as ``worker_lost``."""
        super().__init__(worker_id)
        self.sequence_parallel = sequence_parallel
        if chunk_chars < 4 or chunk_chars % 4 or chunk_chars > MAX_CHUNK_CHARS:
            raise ValueError(f"chunk_chars must be a positive multiple of 4 up to {MAX_CHUNK_CHARS}")
        self.engine = engine
        self.chunk_chars = chunk_chars
        self.max_video_bytes = max_video_bytes
        self._reply_to: dict[str, str] = {}
        self._progress: dict[str, int] = {}

    def accept(self, task: p.Task) -> list[Outbound]:
        if task.request_id in self._reply_to:
            self.cancel(task.request_id)   # the broker re-dispatched a request we still hold: the new attempt wins
        lost = self._group_lost()
        if lost:
            return [self.failure(task.request_id, task.stage, WorkerLost.error_type, lost, attempt=task.attempt)]
        try:
            params = VideoParams.from_wire(task.sampling)
            self.engine.add(VideoTask(task.request_id, params, task.deadline))
        except BadRequest as exc:
            return [self.failure(task.request_id, task.stage, BadRequest.error_type, f"invalid video request: {exc.message}",
                                 attempt=task.attempt)]
        except (TypeError, ValueError) as exc:
            return [self.failure(task.request_id, task.stage, BadRequest.error_type, f"invalid video request: {exc}",
                                 attempt=task.attempt)]
        self._reply_to[task.request_id] = task.reply_to
        self._attempts[task.request_id] = task.attempt
        self._progress[task.request_id] = 0
        return []

    def cancel(self, request_id: str) -> None:
        if self.engine.cancel(request_id):
            log.info("video request %s cancelled", request_id)
        self._forget(request_id)
        self._attempts.pop(request_id, None)

    def _forget(self, request_id: str) -> None:
        self._reply_to.pop(request_id, None)
        self._progress.pop(request_id, None)

    def step(self) -> list[Outbound]:
        result = self.engine.step()
        out: list[Outbound] = []
        for update in result.progress:
            reply_to = self._reply_to.get(update.request_id)
            if reply_to is not None and update.percent > self._progress[update.request_id]:
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
            self._forget(failure.request_id)
            # A job whose forward met the lost group failed inside the engine; another worker may run it.
            error_type = WorkerLost.error_type if lost and failure.error_type == OmniError.error_type else failure.error_type
            out.append(self.failure(failure.request_id, self.role, error_type, failure.message))
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


def build_generate_video_role(config: WorkerConfig, on_lost: Callable[[str], None] | None = None
                              ) -> tuple[GenerateVideoRole, Callable[[], dict]]:
    """The role adapter and heartbeat-stats function for a generate worker whose
    ``config.model_path`` is a diffusers text-to-video pipeline, loaded in ``config.dtype``.
    ``config.capacity`` (by default the stage's ``runtime.max_batch_size``, 1 for diffusion) bounds
    both the requests held and the videos of one shape denoised together. Runs on the first
    CUDA device when there is one, except with ``config.sequence_parallel_size`` > 1 (Wan): then
    its transformers run over that many ranks (this process and the ones it starts, gloo on the
    CPU), which the role's ``sequence_parallel.close`` stops; ``on_lost(reason)`` is called once,
    from any thread, if that group loses a rank (the worker should then stop taking work and exit)."""
    sp_size = config.sequence_parallel_size
    device = "cuda" if torch.cuda.is_available() and sp_size == 1 else "cpu"
    # Ranks 1..N-1 start first: they load their transformers while this process loads the pipeline.
    sequence_parallel = (SequenceParallelDenoiser(config.model_path, sp_size, config.threads, on_lost=on_lost)
                         if sp_size > 1 else None)
    try:
        pipe = load_pipeline(config.model_path, getattr(torch, config.dtype), device)
        if sequence_parallel is not None:
            sequence_parallel.attach(*sequence_parallel.experts_of(pipe))
            log.info("generate worker (video): transformers run over %d sequence-parallel ranks", sp_size)
        engine = GenerateVideoEngine(pipe, max_batch_size=config.capacity)
    except BaseException:
        if sequence_parallel is not None:
            sequence_parallel.close()
        raise
    denoiser = engine.pipe.components.get("unet") or engine.pipe.components.get("transformer")
    weights = next(denoiser.parameters())
    log.info("generate worker (video): %s (%s, runner %s) on %s, denoiser weights %s, encoder %s, batch up to %d",
             config.model_path, type(engine.pipe).__name__, type(engine.runner).__name__, device, weights.dtype,
             engine.encoder, config.capacity)
    weight_bits = weights.element_size() * 8

    def stats() -> dict:
        sp = sequence_parallel.stats if sequence_parallel is not None else {}
        return {**engine.load(), **engine.stats, **sp, "denoiser_weight_bits": weight_bits,
                "sequence_parallel_size": sp_size}

    return GenerateVideoRole(config.worker_id, engine, sequence_parallel=sequence_parallel), stats
