"""``POST /v1/images/generations``: text to images through a generate worker.

Life of a request through the gateway::

    JSON body ──parse_image_request──▶ ImageRequest (400 malformed, 422 asks for what we do not do)
        ──resolve the model──▶ 404 unknown, 422 not an image model
        ──seed chosen here when absent (a retried stage then redraws the same images)
        ──▶ Submit(stages of the model's pipeline, params = ImageParams, deadline, reply_to)
        ──▶ MediaStream: one MediaResult per image, kept by index (duplicates from a retried
            stage dropped), until all n are in — or RequestFailed, or the deadline (504)
        ──▶ {"created", "data": [{"b64_json": …}, …], "output_format": "png"}

The worker sends each image as base64 PNG, so the gateway copies strings through without decoding.
Accepted fields: ``prompt`` (required), ``model`` (optional when exactly one image model is served),
``n`` (1–10), ``size`` ("WxH", multiples of 8, each side ≤ 1024; "auto" or absent: the model's
native size), ``response_format`` (only "b64_json"; "url" is 422), ``output_format`` (only "png"),
and the diffusion extensions ``seed``, ``num_inference_steps``, ``guidance_scale``,
``negative_prompt`` (with the ``openai`` client: ``extra_body``). ``quality``, ``style``,
``moderation`` and ``user`` are hints and ignored; ``stream`` is 422.

A diffusers directory is served as an :class:`ImageModel`: no tokenizer or context length at the
gateway, stages from its pipeline file (``deploy/pipelines/text_to_image.yaml``: one ``generate``).
"""

from __future__ import annotations

import dataclasses
import random
import re
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from omnirelay.broker import protocol as p
from omnirelay.dit_families import family_of_dir
from omnirelay.errors import BadRequest, OmniError, Unprocessable, WorkerLost
from omnirelay.image_params import MAX_SEED, ImageParams

from ..app_keys import BUS, CONFIG, MODELS
from ..bus import BusClient, RequestStream, StreamEvent
from ..config import ServedModel
from ..pipeline_model import PipelineModel
from ..request_body import json_body
from ..request_record import open_record
from ..resubmit import submit_until_done

_SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")


def is_image_pipeline(path: str) -> bool:
    """A diffusers pipeline directory (as opposed to a transformers model)."""
    return (Path(path) / "model_index.json").is_file()


class ImageModel(PipelineModel):
    """A served text-to-image pipeline; ``family`` is its row of :mod:`omnirelay.dit_families`
    (Z-Image), or None."""

    noun, makes, pipeline_file = "image", "images", "deploy/pipelines/text_to_image.yaml"

    def __init__(self, served: ServedModel):
        super().__init__(served)
        self.family = family_of_dir(served.path)

    def resolve(self, request: "ImageRequest") -> ImageParams:
        """The request's parameters with this model's family defaults (steps, guidance) for what it
        did not give; 400 (``size``) for a size the family's transformer cannot patch."""
        params, family = request.params, self.family
        if family is None:
            return params
        if params.width:
            family.check_size(params.width, params.height)
        defaults = {"num_inference_steps": family.default_steps, "guidance_scale": family.default_guidance}
        return msgspec.structs.replace(params, **{k: v for k, v in defaults.items() if k not in request.given})


@dataclasses.dataclass(frozen=True)
class ImageRequest:
    model: str | None
    params: ImageParams
    given: frozenset[str] = frozenset()     # the optional fields the body set


def parse_image_request(body: Any) -> ImageRequest:
    """Validate an OpenAI images.generate body; raises BadRequest (400) or Unprocessable (422)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise BadRequest("'model' must be a non-empty string", param="model")
    response_format = body.get("response_format")
    if response_format not in (None, "b64_json"):
        if response_format == "url":
            raise Unprocessable("response_format 'url' is not supported (images are not stored); use 'b64_json'",
                                param="response_format")
        raise BadRequest("'response_format' must be 'b64_json'", param="response_format")
    output_format = body.get("output_format")
    if output_format not in (None, "png"):
        if output_format in ("jpeg", "webp"):
            raise Unprocessable(f"output_format {output_format!r} is not supported; use 'png'", param="output_format")
        raise BadRequest("'output_format' must be 'png'", param="output_format")
    if body.get("stream") not in (None, False):
        raise Unprocessable("streaming image generation is not supported", param="stream")
    if body.get("partial_images") not in (None, 0):
        raise Unprocessable("partial images are not supported", param="partial_images")
    width, height = _size(body.get("size"))
    fields = {"prompt": body.get("prompt"), "width": width, "height": height}
    if body.get("prompt") is None:
        raise BadRequest("'prompt' is required", param="prompt")
    for name in ("n", "negative_prompt", "num_inference_steps", "guidance_scale", "seed"):
        if body.get(name) is not None:
            fields[name] = body[name]
    steps = fields.get("num_inference_steps")
    if isinstance(steps, int) and not isinstance(steps, bool) and steps <= 0:   # 0 on the wire means "default"
        raise BadRequest(f"'num_inference_steps' must be at least 1, got {steps}", param="num_inference_steps")
    return ImageRequest(model=model, params=ImageParams(**fields), given=frozenset(fields))


def _size(value: Any) -> tuple[int, int]:
    if value is None or value == "auto":
        return 0, 0
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise BadRequest(f"'size' must look like '512x512' (width x height) or 'auto', got {value!r}", param="size")
    width, height = int(match.group(1)), int(match.group(2))
    if not width or not height:
        raise BadRequest("'size' must have a positive width and height", param="size")
    return width, height


class MediaStream(RequestStream):
    """The media of one image request: collects ``count`` items by index into ``received`` (shared
    by the resubmissions of one client request) and finishes when all are in."""

    def __init__(self, request_id: str, deadline: float, count: int, received: dict[int, str]):
        super().__init__(request_id, deadline)
        self.count = count
        self.received = received

    def on_delta(self, delta: p.TokenDelta) -> None:
        """Image requests produce no tokens; a stray delta is ignored."""

    def on_media(self, media: p.MediaResult) -> None:
        if self.finished or not 0 <= media.index < self.count:
            return
        if media.mime != "image/png":
            self.on_error(OmniError(f"worker sent {media.mime!r}, expected image/png", request_id=self.request_id,
                                    stage="generate"))
            return
        self.received.setdefault(media.index, media.data)
        if len(self.received) == self.count:
            self.finished = True
            self._queue.put_nowait(StreamEvent([], "stop"))
        elif media.finish:
            missing = sorted(set(range(self.count)) - set(self.received))
            self.on_error(WorkerLost(f"the generate stage finished without images {missing}",
                                     request_id=self.request_id, stage="generate", resumable=True))

    async def wait(self) -> None:
        """Return once every image is in; raise the request's error or DeadlineExceeded."""
        async for _ in self.events():
            pass


async def generate(bus: BusClient, model: ImageModel, params: ImageParams, deadline: float,
                   request_id: str) -> list[str]:
    """The base64 PNGs of ``params.n`` images, in order. Resubmits after a lost worker or broker
    (same seed, so the same images); waits briefly for a generate role that has no live worker;
    cancels upstream when the caller goes away or fails."""
    received: dict[int, str] = {}   # shared by the resubmissions: an image already in is not awaited again
    submit = p.Submit(request_id=request_id, model=model.name, stages=list(model.stages), prompt_token_ids=[],
                      params=params, deadline=deadline, reply_to=bus.reply_to, reply_key=bus.reply_key)
    await submit_until_done(bus, submit, lambda upstream_id: MediaStream(upstream_id, deadline, params.n, received),
                            progress=lambda: f" ({len(received)} of {params.n} images in)")
    return [received[i] for i in range(params.n)]


async def image_generations(request: web.Request) -> web.Response:
    parsed = parse_image_request(await json_body(request))
    model = ImageModel.find(request.app[MODELS], parsed.model)
    params = model.resolve(parsed)
    if params.seed is None:
        params = msgspec.structs.replace(params, seed=random.randrange(MAX_SEED - params.n))
    return await answer_images(request, model, params, f"img-{uuid.uuid4().hex}")


async def answer_images(request: web.Request, model: ImageModel, params: ImageParams,
                        request_id: str) -> web.Response:
    """Generate ``params`` (a generation or an edit) under the request's metrics and log line and
    answer with OpenAI's images body."""
    open_record(request, model.name, request_id, stages="+".join(model.stages), images=params.n,
                size=f"{params.width}x{params.height}", steps=params.num_inference_steps, seed=params.seed,
                edit=("masked" if params.mask else "whole") if params.image else "no")
    images = await generate(request.app[BUS], model, params, time.time() + request.app[CONFIG].request_timeout_s,
                            request_id)
    body = {"created": int(time.time()), "data": [{"b64_json": data} for data in images], "output_format": "png"}
    return web.json_response(body, headers={"X-Request-Id": request_id})


def add_image_routes(app: web.Application) -> None:
    app.router.add_post("/v1/images/generations", image_generations)
