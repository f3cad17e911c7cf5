"""OpenAI's video API: text to video as asynchronous jobs held by the gateway.

Life of a job::

    POST /v1/videos (JSON, or multipart form as the ``openai`` client sends it)
        ──parse_video_request──▶ VideoParams (400 malformed, 422 asks for what we do not do;
                                  size, frames, fps, steps and seed resolved here)
        ──▶ VideoJob "queued" in VideoJobs (bounded; 429 when full of unfinished jobs) ──▶ 200 job object
    job task (owned by VideoJobs): Submit(stages of the model's pipeline) ──▶ VideoStream
        progress MediaResults ──▶ "in_progress", progress %
        chunk MediaResults (index 0..last, finish on the last) ──▶ bytes joined ──▶ "completed"
        RequestFailed / deadline / stall ──▶ "failed" with error {code, message naming the stage}
    GET /v1/videos/{id}            the job object
    GET /v1/videos/{id}/content    the file (video/mp4; image/webp where the worker has no MP4 encoder)
    DELETE /v1/videos/{id}         unfinished: cancels upstream (the worker stops denoising), the
                                   job stays "cancelled" until its TTL; finished: removed (404 after)
    GET /v1/videos                 the jobs, newest first (``limit``, ``after``, ``order``)
    POST /v1/videos/sync           the same request, answered with the file once it is done (no job
                                   is kept; a client that disconnects cancels it upstream)

Job object: ``{id, object: "video", status: queued|in_progress|completed|failed|cancelled,
progress, model, prompt, created_at, completed_at, expires_at, size, seconds, error}`` — OpenAI's
shape, plus ``cancelled``. A finished job (and its content) lives ``ttl_s`` after it finished
(``expires_at``); the store holds at most ``max_jobs`` jobs and ``max_bytes`` of content, evicting
the oldest finished jobs first. Jobs are state of one gateway process: a client polls the gateway
that created the job (a load balancer needs affinity on the job id) and a gateway restart loses them.

Deadline: a job is not a request waiting for tokens. It may run up to ``--video-timeout`` (hours by
default; the Submit's deadline, so the broker and the worker hold it as long) and lives as long as
it makes progress: once its worker reported on it, a job that reports nothing more (no progress
report, no chunk) for ``--video-stall-timeout`` fails with ``deadline_exceeded``, as does one past
its video timeout; the message names where it was (queued, or the pipeline stage, denoising or
sending the file, and the progress). A queued job waits its turn under the video timeout alone (the
broker's queues are bounded, and a worker that dies is dropped by the broker, its job resubmitted).

Accepted fields: ``prompt`` (required), ``model`` (optional when exactly one video model is
served), ``size`` ("WxH", multiples of 8; default the model's native size), ``seconds`` (default
4), and the diffusion extensions ``fps`` (default 8), ``num_frames`` (default ``seconds × fps``),
``seed``, ``num_inference_steps``, ``guidance_scale``, ``negative_prompt``, and step caching for this
request, ``cache_backend`` with ``cache_config`` (:mod:`omnirelay.step_cache_params`; 422 from the
worker for a pipeline without a step cache) (with the ``openai`` client: ``extra_body``).
``input_reference`` (image to video) is 422.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import dataclasses
import json
import logging
import random
import re
import time
import uuid
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from omnirelay.broker import protocol as p
from omnirelay.dit_families import family_of_dir
from omnirelay.step_cache_params import spec_from
from omnirelay.errors import (BadRequest, DeadlineExceeded, NotFound, OmniError, Overloaded, PayloadTooLarge,
                              Unprocessable, WorkerLost)
from omnirelay.video_params import (DEFAULT_FPS, MAX_FRAMES, MAX_SECONDS, MAX_SEED, MAX_VIDEO_BYTES, PROGRESS_MIME,
                                    VideoParams, check_int, native_size)

from ..app_keys import BUS, CONFIG, METRICS, MODELS
from ..bus import BusClient, RequestStream, StreamEvent
from ..config import ServedModel
from ..pipeline_model import PipelineModel
from ..request_body import json_body
from ..request_record import RequestRecord
from ..resubmit import submit_until_done

log = logging.getLogger("omnirelay.gateway")

DEFAULT_SECONDS = 4
_SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")
_INT_FIELDS = ("num_frames", "fps", "num_inference_steps", "seed")
_FLOAT_FIELDS = ("guidance_scale",)
FINISHED = ("completed", "failed", "cancelled")


class VideoModel(PipelineModel):
    """A served text-to-video pipeline, with the native size it makes and its row of
    :mod:`omnirelay.dit_families` (Wan), or None."""

    what, noun, makes, pipeline_file = "video pipeline", "video", "video", "deploy/pipelines/text_to_video.yaml"

    def __init__(self, served: ServedModel):
        super().__init__(served)
        self.family = family_of_dir(served.path)
        self.native_size = native_size(served.path) or (self.family.native_size if self.family else None)


# ---------------------------------------------------------------------------------------- parsing


@dataclasses.dataclass(frozen=True)
class VideoRequest:
    model: str | None
    prompt: str
    size: tuple[int, int] | None      # None: the model's native size
    seconds: str | None               # as asked; None: derived from num_frames or the default
    fields: dict                      # the VideoParams fields given (typed)


def parse_video_request(body: Any) -> VideoRequest:
    """Validate an OpenAI videos.create body (JSON values, or the strings of a form)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise BadRequest("'model' must be a non-empty string", param="model")
    if body.get("input_reference") not in (None, ""):
        raise Unprocessable("'input_reference' (image to video) is not supported", param="input_reference")
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required", param="prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadRequest("'prompt' must be a non-empty string", param="prompt")
    size = None
    if body.get("size") not in (None, "auto"):
        match = _SIZE.fullmatch(body["size"]) if isinstance(body["size"], str) else None
        if match is None:
            raise BadRequest(f"'size' must look like '720x1280' (width x height), got {body['size']!r}", param="size")
        size = (int(match.group(1)), int(match.group(2)))
    seconds = body.get("seconds")
    if seconds is not None:
        seconds = _number(seconds, "seconds", float)
        if not 0 < seconds <= MAX_SECONDS:
            raise BadRequest(f"'seconds' must be more than 0 and at most {MAX_SECONDS}", param="seconds")
        seconds = f"{seconds:g}"
    fields: dict[str, Any] = {}
    for name in _INT_FIELDS + _FLOAT_FIELDS + ("negative_prompt",):
        value = body.get(name)
        if value is None:
            continue
        if name in _INT_FIELDS:
            value = _number(value, name, int)
        elif name in _FLOAT_FIELDS:
            value = _number(value, name, float)
        elif not isinstance(value, str):
            raise BadRequest(f"'{name}' must be a string", param=name)
        fields[name] = value
    cache_config = _form_object(body, "cache_config")
    if body.get("cache_backend") is not None or cache_config is not None:
        if body.get("cache_backend") is None:
            raise BadRequest("'cache_config' needs 'cache_backend'", param="cache_backend")
        fields["cache"] = spec_from(body["cache_backend"], cache_config)
    return VideoRequest(model, prompt, size, seconds, fields)


def _form_object(body: dict, name: str) -> Any:
    """``body[name]``, or the object a form spelled as ``name[key]`` fields (how the ``openai``
    client sends a dict of ``extra_body`` in a multipart body), each value read as JSON text."""
    prefix = name + "["
    keyed = {key[len(prefix):-1]: value for key, value in body.items() if key.startswith(prefix) and key.endswith("]")}
    if not keyed:
        return body.get(name)
    if name in body or any("[" in key or "]" in key for key in keyed):
        raise BadRequest(f"'{name}' in a form takes scalar keys; give lists as one JSON string field", param=name)
    try:
        return {key: json.loads(value) if isinstance(value, str) else value for key, value in keyed.items()}
    except ValueError:
        raise BadRequest(f"'{name}' form fields must be JSON values", param=name) from None


def _number(value: Any, name: str, kind: type) -> int | float:
    """A number from JSON or from a form field's text (the ``openai`` client sends forms)."""
    if isinstance(value, str):
        try:
            value = kind(value.strip())
        except ValueError:
            raise BadRequest(f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {value!r}",
                             param=name) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise BadRequest(f"'{name}' must be {'an integer' if kind is int else 'a number'}", param=name)
    return value


def resolve_params(request: VideoRequest, model: VideoModel) -> tuple[VideoParams, str]:
    """Every default applied: (VideoParams, the clip's length in seconds as reported)."""
    width, height = request.size or model.native_size or (0, 0)
    if not width:
        raise BadRequest(f"model {model.name!r} does not state its native size; give 'size'", param="size")
    fields = dict(request.fields)
    family = model.family
    if family is not None:   # Wan: its own fps, steps and guidance; sizes and frames its patching takes
        family.check_size(width, height)
        for name, value in (("fps", family.default_fps), ("num_inference_steps", family.default_steps),
                            ("guidance_scale", family.default_guidance)):
            fields.setdefault(name, value)
    fps = fields.setdefault("fps", DEFAULT_FPS)
    check_int(fps, "fps", 1, 60)
    if "num_frames" not in fields:
        frames = round(float(request.seconds or DEFAULT_SECONDS) * fps)
        if family is not None:
            frames = family.round_frames(frames)
        if not 1 <= frames <= MAX_FRAMES:
            raise BadRequest(f"'seconds' × 'fps' is {frames} frames; the limit is 1 to {MAX_FRAMES}", param="seconds")
        fields["num_frames"] = frames
    elif family is not None and isinstance(fields["num_frames"], int):
        family.check_frames(fields["num_frames"])
    if "seed" not in fields:
        fields["seed"] = random.randrange(MAX_SEED)
    params = VideoParams(prompt=request.prompt, width=width, height=height, **fields)
    return params, request.seconds or f"{params.num_frames / params.fps:g}"


# ---------------------------------------------------------------------------------------- jobs


@dataclasses.dataclass
class VideoJob:
    """One job as the client sees it; ``content`` is the file once completed."""

    id: str
    model: str
    params: VideoParams
    seconds: str
    created_at: int
    status: str = "queued"
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict | None = None
    content: bytes | None = None
    mime: str = ""
    task: asyncio.Task | None = None

    def to_json(self) -> dict:
        return {"id": self.id, "object": "video", "status": self.status, "progress": self.progress,
                "model": self.model, "prompt": self.params.prompt, "created_at": self.created_at,
                "completed_at": self.completed_at, "expires_at": self.expires_at,
                "size": f"{self.params.width}x{self.params.height}", "seconds": self.seconds,
                "remixed_from_video_id": None, "error": self.error}

    def finish(self, status: str, now: float, ttl_s: float, error: OmniError | None = None) -> None:
        self.status = status
        self.completed_at = int(now)
        self.expires_at = int(now + ttl_s)
        if status == "completed":
            self.progress = 100
        if error is not None:
            message = error.message
            if error.stage and error.stage not in message:   # where it failed (a worker's, the broker's error)
                message += f" (stage {error.stage})"
            self.error = {"code": error.error_type, "message": message}


class VideoJobs:
    """The gateway's jobs, insertion-ordered. Owns every job's task: :meth:`close` cancels and
    joins them (each cancel reaches the worker), so no task outlives the app."""

    def __init__(self, *, max_jobs: int = 256, ttl_s: float = 3600.0, max_bytes: int = 2 * 1024**3, clock=time.time):
        if max_jobs < 1 or ttl_s <= 0 or max_bytes < 1:
            raise ValueError("max_jobs, ttl_s and max_bytes must be positive")
        self.max_jobs, self.ttl_s, self.max_bytes, self.clock = max_jobs, ttl_s, max_bytes, clock
        self.jobs: collections.OrderedDict[str, VideoJob] = collections.OrderedDict()

    def add(self, job: VideoJob) -> None:
        """Admit a job, evicting expired and then the oldest finished jobs; Overloaded when every
        slot holds an unfinished job."""
        self.purge()
        while len(self.jobs) >= self.max_jobs:
            oldest = next((j for j in self.jobs.values() if j.status in FINISHED), None)
            if oldest is None:
                raise Overloaded(f"{len(self.jobs)} video jobs are already running or queued", retry_after=5)
            del self.jobs[oldest.id]
        self.jobs[job.id] = job

    def get(self, job_id: str) -> VideoJob:
        self.purge()
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFound(f"video {job_id!r} does not exist (or expired)", param="video_id")
        return job

    def purge(self) -> None:
        """Forget finished jobs past their TTL; then drop the oldest content over the byte budget."""
        now = self.clock()
        for job in [j for j in self.jobs.values() if j.expires_at is not None and now >= j.expires_at]:
            del self.jobs[job.id]
        total = sum(len(j.content or b"") for j in self.jobs.values())
        for job in list(self.jobs.values()):
            if total <= self.max_bytes:
                break
            if job.content is not None:
                total -= len(job.content)
                del self.jobs[job.id]

    async def cancel(self, job: VideoJob) -> None:
        """Stop an unfinished job: its task sends the upstream cancel as it unwinds."""
        if job.status in FINISHED:
            return
        job.finish("cancelled", self.clock(), self.ttl_s)
        if job.task is not None:
            job.task.cancel()
            await asyncio.gather(job.task, return_exceptions=True)

    def remove(self, job: VideoJob) -> None:
        self.jobs.pop(job.id, None)

    async def close(self) -> None:
        tasks = [j.task for j in self.jobs.values() if j.task is not None and not j.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


JOBS = web.AppKey("video_jobs", VideoJobs)


class VideoStream(RequestStream):
    """One attempt's worker messages for a job: progress into ``job``, chunks joined into ``data``.
    It waits until ``deadline`` (the job's video timeout), and once the worker reported on it at
    most ``stall_s`` after its last message; ``stage`` is the pipeline stage that reports."""

    def __init__(self, request_id: str, deadline: float, job: VideoJob, *, stall_s: float = float("inf"),
                 stage: str = "generate"):
        super().__init__(request_id, deadline)
        self.job = job
        self.chunks: dict[int, bytes] = {}
        self.last: int | None = None
        self.mime = ""
        self.size = 0
        self.stall_s, self.stage = stall_s, stage
        self.heard_at = time.time()   # the last sign of progress (wall clock, as the deadline)
        self.phase = "queued"         # → denoising → sending the file

    def on_delta(self, delta: p.TokenDelta) -> None:
        """Video requests produce no tokens; a stray delta is ignored."""

    def on_media(self, media: p.MediaResult) -> None:
        if self.finished:
            return
        self.heard_at = time.time()
        if media.mime == PROGRESS_MIME:
            if self.phase == "queued":
                self.phase = "denoising"
            if media.data.isdigit() and self.job.status in ("queued", "in_progress"):
                self.job.status = "in_progress"
                self.job.progress = max(self.job.progress, min(99, int(media.data)))
            return
        if media.index < 0 or media.index in self.chunks:
            return
        if not (media.mime.startswith("video/") or media.mime == "image/webp") or \
                (self.mime and media.mime != self.mime):
            self.on_error(OmniError(f"worker sent {media.mime!r}, expected a video", request_id=self.request_id,
                                    stage="generate"))
            return
        try:
            chunk = base64.b64decode(media.data, validate=True)
        except (binascii.Error, ValueError):
            self.on_error(OmniError("worker sent a chunk that is not base64", request_id=self.request_id,
                                    stage="generate"))
            return
        self.size += len(chunk)
        if self.size > MAX_VIDEO_BYTES:
            self.on_error(PayloadTooLarge(f"the video exceeds {MAX_VIDEO_BYTES} bytes", request_id=self.request_id,
                                          stage="generate"))
            return
        self.mime = media.mime
        self.chunks[media.index] = chunk
        self.phase = "sending the file"
        if self.job.status == "queued":
            self.job.status = "in_progress"
        if media.finish:
            self.last = media.index
        if self.last is not None and len(self.chunks) == self.last + 1 and max(self.chunks) == self.last:
            self.finished = True
            self._queue.put_nowait(StreamEvent([], "stop"))
        elif self.last is not None and max(self.chunks) > self.last:
            self.on_error(WorkerLost("the generate stage sent chunks past its last one", request_id=self.request_id,
                                     stage="generate", resumable=True))

    async def wait(self) -> bytes:
        """The whole file once every chunk is in; raise the request's error, or DeadlineExceeded
        past the deadline or ``stall_s`` without a message."""
        while True:
            try:
                async with asyncio.timeout(max(0.0, self._until() - time.time())):
                    event = await self._queue.get()
            except TimeoutError:
                if time.time() < self._until():
                    continue   # progress came meanwhile (it moves heard_at, not the queue): wait on
                raise self._timed_out() from None
            if isinstance(event, OmniError):
                raise event
            if event.finish_reason:
                return b"".join(self.chunks[k] for k in range(self.last + 1))

    def _until(self) -> float:
        """When the wait ends without a message: the deadline, or a stall once the job started."""
        return self.deadline if self.phase == "queued" else min(self.deadline, self.heard_at + self.stall_s)

    def _timed_out(self) -> DeadlineExceeded:
        where = ("queued (no stage reported yet)" if self.phase == "queued" else
                 f"in stage {self.stage} ({self.phase}, {self.job.progress} %)")
        if time.time() >= self.deadline:
            what = "passed its video timeout (--video-timeout)"
        else:
            what = f"made no progress for {self.stall_s:g} s (--video-stall-timeout)"
        return DeadlineExceeded(f"the video job {what} {where}", request_id=self.request_id,
                                stage="" if self.phase == "queued" else self.stage)


async def run_job(bus: BusClient, model: VideoModel, job: VideoJob, deadline: float,
                  stall_s: float = float("inf")) -> tuple[bytes, str]:
    """Generate ``job``'s file: (bytes, MIME). Resubmits after a lost worker or broker (same
    seed, so the same file); waits briefly for a generate role with no live worker; cancels
    upstream when cancelled or failed, or after ``stall_s`` without progress (VideoStream)."""
    submit = p.Submit(request_id=job.id, model=model.name, stages=list(model.stages), prompt_token_ids=[],
                      params=job.params, deadline=deadline, reply_to=bus.reply_to, reply_key=bus.reply_key)
    data, stream = await submit_until_done(bus, submit, lambda upstream_id: VideoStream(upstream_id, deadline, job, stall_s=stall_s,
                                                                                 stage=model.stages[-1]),
                                           cancel_reason="video job cancelled or failed")
    return data, stream.mime


async def _generate(app: web.Application, model: VideoModel, job: VideoJob) -> tuple[bytes, str]:
    """:func:`run_job` under the request's metrics and log line; raises what it raises."""
    config, params = app[CONFIG], job.params
    # The job outlives its HTTP request: the record is finished here, not by the middleware.
    with RequestRecord(app[METRICS], model.name, job.id, log_requests=not config.disable_log_requests, kind="video",
                       size=f"{params.width}x{params.height}", frames=params.num_frames, fps=params.fps,
                       steps=params.num_inference_steps, seed=params.seed, bytes=0) as record:
        # The job's own deadline, not a request's: it lives while it progresses (module docstring).
        data, mime = await run_job(app[BUS], model, job, time.time() + config.video_timeout_s,
                                   stall_s=config.video_stall_timeout_s)
        record.fields["bytes"] = len(data)
        return data, mime


async def _job_task(app: web.Application, model: VideoModel, job: VideoJob) -> None:
    """The life of one job after its 200: run it, then record how it ended."""
    jobs = app[JOBS]
    try:
        job.content, job.mime = await _generate(app, model, job)
        job.finish("completed", jobs.clock(), jobs.ttl_s)
    except OmniError as exc:
        job.finish("failed", jobs.clock(), jobs.ttl_s, exc)
    except asyncio.CancelledError:
        if job.status not in FINISHED:
            job.finish("cancelled", jobs.clock(), jobs.ttl_s)
        raise
    except Exception as exc:   # a bug: the job fails visibly instead of staying in_progress forever
        log.exception("video job %s crashed", job.id)
        job.finish("failed", jobs.clock(), jobs.ttl_s, OmniError(f"internal error: {type(exc).__name__}"))
    finally:
        jobs.purge()


# ---------------------------------------------------------------------------------------- routes


async def _body(request: web.Request) -> dict:
    """The fields of a JSON body or of a form (multipart or urlencoded)."""
    if request.content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
        try:
            form = await request.post()
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLarge(f"request body exceeds {request.app[CONFIG].max_body_bytes} bytes") from None
        except (ValueError, HttpProcessingError) as exc:   # a part's bad header is the latter, not a ValueError
            raise BadRequest(f"malformed form body: {exc}") from None
        fields: dict[str, Any] = {}
        for key, value in form.items():
            if key in fields:
                raise BadRequest(f"field {key!r} is given twice", param=key)
            fields[key] = value if isinstance(value, str) else "<file>"
        return fields
    return await json_body(request)


async def create_video(request: web.Request) -> web.Response:
    parsed = parse_video_request(await _body(request))
    model = VideoModel.find(request.app[MODELS], parsed.model)
    params, seconds = resolve_params(parsed, model)
    jobs: VideoJobs = request.app[JOBS]
    job = VideoJob(id=f"video_{uuid.uuid4().hex}", model=model.name, params=params, seconds=seconds,
                   created_at=int(jobs.clock()))
    jobs.add(job)
    job.task = asyncio.get_running_loop().create_task(_job_task(request.app, model, job), name=job.id)
    return web.json_response(job.to_json(), headers={"X-Request-Id": job.id})


async def create_video_sync(request: web.Request) -> web.Response:
    """``POST /v1/videos/sync``: the same request as ``POST /v1/videos``, answered with the file
    itself once it is generated (no job is stored). The request deadline bounds it; a client that
    disconnects cancels the handler (the server runs with handler cancellation), which cancels the
    request upstream, so the worker stops denoising."""
    parsed = parse_video_request(await _body(request))
    model = VideoModel.find(request.app[MODELS], parsed.model)
    params, seconds = resolve_params(parsed, model)
    job = VideoJob(id=f"video_{uuid.uuid4().hex}", model=model.name, params=params, seconds=seconds,
                   created_at=int(time.time()))
    data, mime = await _generate(request.app, model, job)
    return web.Response(body=data, content_type=mime, headers={
        "X-Request-Id": job.id, "Content-Disposition": f'attachment; filename="{job.id}.{_extension(mime)}"'})


def _extension(mime: str) -> str:
    return "mp4" if mime == "video/mp4" else mime.rpartition("/")[2]


async def retrieve_video(request: web.Request) -> web.Response:
    return web.json_response(request.app[JOBS].get(request.match_info["video_id"]).to_json())


async def video_content(request: web.Request) -> web.Response:
    job = request.app[JOBS].get(request.match_info["video_id"])
    variant = request.query.get("variant", "video")
    if variant != "video":
        raise Unprocessable(f"variant {variant!r} is not available; only 'video'", param="variant")
    if job.status != "completed" or job.content is None:
        raise NotFound(f"video {job.id!r} has no content: it is {job.status}", param="video_id")
    return web.Response(body=job.content, content_type=job.mime,
                        headers={"Content-Disposition": f'attachment; filename="{job.id}.{_extension(job.mime)}"'})


async def delete_video(request: web.Request) -> web.Response:
    jobs: VideoJobs = request.app[JOBS]
    job = jobs.get(request.match_info["video_id"])
    if job.status in FINISHED:
        jobs.remove(job)
    else:
        await jobs.cancel(job)
    return web.json_response({"id": job.id, "object": "video.deleted", "deleted": True})


async def list_videos(request: web.Request) -> web.Response:
    jobs: VideoJobs = request.app[JOBS]
    jobs.purge()
    query = request.query
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("'order' must be 'asc' or 'desc'", param="order")
    limit = _number(query.get("limit", "20"), "limit", int)
    if not 1 <= limit <= 100:
        raise BadRequest("'limit' must be between 1 and 100", param="limit")
    items = list(jobs.jobs.values())
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [j.id for j in items]
        if after not in ids:
            raise NotFound(f"video {after!r} does not exist (or expired)", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return web.json_response({"object": "list", "data": [j.to_json() for j in page],
                              "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
                              "has_more": len(items) > limit})


async def _jobs_context(app: web.Application):
    # Appended after the bus's context, so it is cleaned up first: the jobs' cancels still have a bus.
    jobs = VideoJobs()
    app[JOBS] = jobs
    yield
    await jobs.close()


def add_video_routes(app: web.Application) -> None:
    app.cleanup_ctx.append(_jobs_context)
    app.router.add_post("/v1/videos", create_video)
    app.router.add_post("/v1/videos/sync", create_video_sync)
    app.router.add_get("/v1/videos", list_videos)
    app.router.add_get("/v1/videos/{video_id}", retrieve_video)
    app.router.add_get("/v1/videos/{video_id}/content", video_content)
    app.router.add_delete("/v1/videos/{video_id}", delete_video)
