"""``/v1/audio/voices``: the voices each speech model speaks with.

``GET /v1/audio/voices[?model=NAME]`` lists them: ``{"object": "list", "data": [{"id", "name",
"model", "type": "preset"}]}``, every served speech model's speakers (Qwen2.5-Omni's and Qwen3-Omni's
speaker tables, Qwen3-TTS's ``spk_id``), sorted by model then name. A voice's ``id`` is what
``voice`` takes in ``/v1/audio/speech`` and in chat's ``audio``.

``POST /v1/audio/voices`` (multipart: ``model``, ``name``, ``file`` a WAV reference clip, optional
``transcript``) creates a custom voice only for a model family that clones voices from a reference
clip. None of the families served here does (their voices are trained speaker embeddings), so a
well-formed upload is a 422 naming ``model``; the fields are still checked first (400 naming the
field: a name that is not ``[A-Za-z0-9_-]{1,64}`` or clashes with a preset, a clip that is not a
readable WAV or is longer than :data:`MAX_CLIP_SECONDS`, a body over :data:`MAX_UPLOAD_BYTES`).
``DELETE /v1/audio/voices/{name}``: a preset voice cannot be removed (422), an unknown one is a 404.
"""

from __future__ import annotations

import io
import re
import wave

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from omnirelay.errors import BadRequest, NotFound, PayloadTooLarge, Unprocessable

from ..app_keys import MODELS
from ..models import ModelRuntime
from .speech import has_speakers, voices

MAX_UPLOAD_BYTES = 10 * 1024 * 1024
MAX_CLIP_SECONDS = 60
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def speech_models(models: dict) -> list[ModelRuntime]:
    return [m for m in models.values() if isinstance(m, ModelRuntime) and "generate" in m.stages and has_speakers(m)]


def _voice_entries(model: ModelRuntime) -> list[dict]:
    return [{"id": name, "object": "voice", "name": name, "model": model.name, "type": "preset"}
            for name in voices(model) or []]


async def list_voices(request: web.Request) -> web.Response:
    served = speech_models(request.app[MODELS])
    name = request.query.get("model")
    if name is not None:
        served = [m for m in served if m.name == name]
        if not served:
            raise NotFound(f"no speech model named {name!r}; see GET /v1/models", param="model")
    data = [entry for model in sorted(served, key=lambda m: m.name) for entry in _voice_entries(model)]
    return web.json_response({"object": "list", "data": data})


async def create_voice(request: web.Request) -> web.Response:
    if request.content_type != "multipart/form-data":
        raise BadRequest("upload a voice as multipart/form-data (model, name, file, transcript)")
    if request.content_length is not None and request.content_length > MAX_UPLOAD_BYTES:
        raise PayloadTooLarge(f"a voice upload is at most {MAX_UPLOAD_BYTES} bytes", param="file")
    try:
        form = await request.post()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"a voice upload is at most {MAX_UPLOAD_BYTES} bytes", param="file") from None
    except (ValueError, HttpProcessingError) as exc:
        raise BadRequest(f"malformed form body: {exc}") from None
    models = {m.name: m for m in speech_models(request.app[MODELS])}
    model = models.get(form.get("model")) if isinstance(form.get("model"), str) else None
    if model is None:
        raise NotFound(f"no speech model named {form.get('model')!r}; see GET /v1/audio/voices", param="model")
    name = form.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadRequest("'name' must be 1 to 64 letters, digits, '_' or '-'", param="name")
    if name in (voices(model) or []):
        raise BadRequest(f"{name!r} is a preset voice of {model.name!r}", param="name")
    upload = form.get("file")
    if isinstance(upload, str) or upload is None:
        raise BadRequest("'file' must be an uploaded WAV clip", param="file")
    data = upload.file.read(MAX_UPLOAD_BYTES + 1)
    if len(data) > MAX_UPLOAD_BYTES:
        raise PayloadTooLarge(f"a voice clip is at most {MAX_UPLOAD_BYTES} bytes", param="file")
    _check_clip(data)
    transcript = form.get("transcript")
    if transcript is not None and not isinstance(transcript, str):
        raise BadRequest("'transcript' must be text", param="transcript")
    raise Unprocessable(f"model {model.name!r} speaks only its preset voices ({', '.join(voices(model) or [])}); "
                        "its family does not clone a voice from a reference clip", param="model")


def _check_clip(data: bytes) -> None:
    try:
        with wave.open(io.BytesIO(data)) as clip:
            frames, rate = clip.getnframes(), clip.getframerate()
    except (wave.Error, EOFError):
        raise BadRequest("'file' is not a readable WAV file", param="file") from None
    if rate <= 0 or frames == 0:
        raise BadRequest("'file' holds no audio", param="file")
    if frames / rate > MAX_CLIP_SECONDS:
        raise BadRequest(f"'file' is {frames / rate:.0f} s long; a reference clip is at most {MAX_CLIP_SECONDS} s",
                         param="file")


async def delete_voice(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    owners = [m.name for m in speech_models(request.app[MODELS]) if name in (voices(m) or [])]
    if not owners:
        raise NotFound(f"no voice named {name!r}; see GET /v1/audio/voices", param="name")
    raise Unprocessable(f"{name!r} is a preset voice of {', '.join(owners)} and cannot be deleted", param="name")


def add_voice_routes(app: web.Application) -> None:
    app.router.add_get("/v1/audio/voices", list_voices)
    app.router.add_post("/v1/audio/voices", create_voice)
    app.router.add_delete("/v1/audio/voices/{name}", delete_voice)
