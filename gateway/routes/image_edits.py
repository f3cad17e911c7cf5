"""``POST /v1/images/edits``: an input image (and optionally a mask) plus a prompt → edited images.

Life of a request through the gateway::

    multipart form (OpenAI's fields: image, mask, prompt, n, size, response_format, model; the
        diffusion extensions seed, num_inference_steps, guidance_scale, negative_prompt, strength)
        ──▶ the model: 404 unknown, 422 not an image model or one whose pipeline cannot edit
        ──▶ image: decoded (PNG, JPEG or WebP; 400 otherwise), resized to the output size and sent
            as PNG; mask: a PNG with an alpha channel and the image's size (400 otherwise), whose
            transparent pixels mark what to repaint, sent as a grey mask (white: repaint)
        ──▶ the same path as a generation (gateway/routes/images.py ``generate``): one Submit, the images
            back as base64 PNGs ──▶ {"created", "data": [{"b64_json"}], "output_format": "png"}

Output size: ``size`` when given, else the input image's size, each side rounded down to the
model's size multiple and capped at :data:`~omnirelay.image_params.MAX_SIDE` (keeping the aspect).
Without a mask the whole image is re-noised to ``strength`` (default 0.8) and denoised towards the
prompt (image-to-image); with one only the masked area is repainted (inpainting, default strength 1).
"""

from __future__ import annotations

import base64
import io
import random
import uuid
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from omnirelay.errors import BadRequest, PayloadTooLarge, Unprocessable
from omnirelay.image_params import EDITABLE_PIPELINES, MAX_SEED, MAX_SIDE, SIZE_MULTIPLE

from ..app_keys import CONFIG, MODELS
from .images import ImageModel, answer_images, parse_image_request

MAX_INPUT_PIXELS = 4096 * 4096          # a bigger upload is refused before it is decoded
_FORMATS = ("PNG", "JPEG", "WEBP")
_NUMBER_FIELDS = {"n": int, "num_inference_steps": int, "seed": int, "guidance_scale": float, "strength": float}


async def _form(request: web.Request) -> tuple[dict[str, Any], dict[str, bytes]]:
    if request.content_type != "multipart/form-data":
        raise BadRequest("an edit is a multipart/form-data upload (image, prompt, optional mask)")
    try:
        form = await request.post()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body exceeds {request.app[CONFIG].max_body_bytes} bytes") from None
    except (ValueError, HttpProcessingError) as exc:
        raise BadRequest(f"malformed form body: {exc}") from None
    fields: dict[str, Any] = {}
    files: dict[str, bytes] = {}
    for key, value in form.items():
        name = key.removesuffix("[]")   # the openai client may send image[] for a list of images
        if name in fields or name in files:
            raise BadRequest(f"field {name!r} is given twice (one image per edit)", param=name)
        if isinstance(value, str):
            fields[name] = value
        else:
            files[name] = value.file.read()
    for name, kind in _NUMBER_FIELDS.items():
        if name in fields:
            try:
                fields[name] = kind(fields[name])
            except ValueError:
                raise BadRequest(f"'{name}' must be a number", param=name) from None
    return fields, files


def _open(data: bytes, param: str):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        if image.format not in _FORMATS:
            raise BadRequest(f"'{param}' must be a PNG, JPEG or WebP image, got {image.format}", param=param)
        if image.width * image.height > MAX_INPUT_PIXELS:
            raise BadRequest(f"'{param}' is {image.width}x{image.height}; at most {MAX_INPUT_PIXELS} pixels",
                             param=param)
        image.load()
        return image
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise BadRequest(f"'{param}' is not an image this server reads: {exc}", param=param) from None


def _png(image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")


def _output_size(width: int, height: int, multiple: int) -> tuple[int, int]:
    scale = min(1.0, MAX_SIDE / max(width, height))
    w, h = int(width * scale) // multiple * multiple, int(height * scale) // multiple * multiple
    if not w or not h:
        raise BadRequest(f"the image is too small to edit: each side needs at least {multiple} pixels",
                         param="image")
    return w, h


def prepare_edit(model: ImageModel, fields: dict, files: dict[str, bytes]):
    """The request's ImageParams with the image (and mask) attached; 400/422 naming the field."""
    from PIL import Image

    if model.pipeline_class not in EDITABLE_PIPELINES:
        raise Unprocessable(f"model {model.name!r} ({model.pipeline_class}) cannot edit images", param="model")
    if "image" not in files:
        raise BadRequest("'image' is required: the image to edit, as a file", param="image")
    unknown = set(files) - {"image", "mask"}
    if unknown:
        raise BadRequest(f"unexpected file field {sorted(unknown)[0]!r}", param=sorted(unknown)[0])
    strength = fields.pop("strength", None)
    parsed = parse_image_request({k: v for k, v in fields.items() if k not in ("image", "mask")})
    params = model.resolve(parsed)
    image = _open(files["image"], "image")
    multiple = model.family.size_multiple if model.family is not None else SIZE_MULTIPLE
    width, height = (params.width, params.height) if params.width else _output_size(*image.size, multiple)
    mask_png = ""
    if "mask" in files:
        mask = _open(files["mask"], "mask")
        if mask.size != image.size:
            raise BadRequest(f"the mask is {mask.size[0]}x{mask.size[1]}, the image {image.size[0]}x{image.size[1]}: "
                             "they must be the same size", param="mask")
        if "A" not in mask.getbands():
            raise BadRequest("the mask must have an alpha channel: its transparent pixels mark what to edit",
                             param="mask")
        repaint = mask.getchannel("A").point(lambda alpha: 255 if alpha == 0 else 0)
        mask_png = _png(repaint.resize((width, height), Image.NEAREST))
    image_png = _png(image.convert("RGB").resize((width, height), Image.LANCZOS))
    extra = {"strength": strength} if strength is not None else {}
    return msgspec.structs.replace(params, width=width, height=height, image=image_png, mask=mask_png, **extra)


async def image_edits(request: web.Request) -> web.Response:
    fields, files = await _form(request)
    model = ImageModel.find(request.app[MODELS], fields.get("model"))
    params = prepare_edit(model, fields, files)
    if params.seed is None:
        params = msgspec.structs.replace(params, seed=random.randrange(MAX_SEED - params.n))
    return await answer_images(request, model, params, f"imgedit-{uuid.uuid4().hex}")


def add_image_edit_routes(app: web.Application) -> None:
    app.router.add_post("/v1/images/edits", image_edits)
