"""What an image request asks for: one typed object shared by the gateway and the generate worker.

The gateway builds :class:`ImageParams` from ``POST /v1/images/generations`` and sends it in the
``params`` of :class:`~omnirelay.broker.protocol.Submit` (tag ``image``); the generate worker
reads it from :class:`~omnirelay.broker.protocol.Task`, decoded and checked by the bus decoder.
Its checks run where the gateway builds it and where the bus decodes it, so a request the gateway
let through is never rejected for its shape by the worker, and a malformed one is refused on the bus.
The prompt travels in these params because a diffusion pipeline tokenizes with its own text encoder's
tokenizer, which the gateway does not load (``prompt_token_ids`` stays empty).

Bounds are the gateway's; a model may narrow them (a size its VAE cannot produce is refused by the
worker with ``bad_request``). ``width``/``height``/``num_inference_steps`` of 0 mean "the model's
default" (the pipeline's native resolution, diffusers' 50 steps).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from omnirelay.errors import InvalidParam

MAX_PROMPT_CHARS = 4000
MAX_IMAGES = 10                 # OpenAI's bound on ``n``
MAX_SIDE = 1024                 # pixels: a 1024×1024 PNG (≤ ~4 MiB in base64) fits one bus message
SIZE_MULTIPLE = 8               # Stable Diffusion's VAE: one latent per 8×8 pixels
MAX_STEPS = 150
MAX_GUIDANCE = 50.0
MAX_SEED = 2**63 - 1
# An edit's input image and mask travel in the request's bus message as base64 PNG at the output size
# (re-encoded by the gateway), so together they stay well inside one message (MAX_BODY_BYTES, 8 MiB).
MAX_EDIT_IMAGE_CHARS = 6 * 1024 * 1024
# Text-to-image classes (model_index.json's ``_class_name``) whose components diffusers also runs as
# image-to-image and inpainting pipelines: the models that serve edits.
EDITABLE_PIPELINES = frozenset({"StableDiffusionPipeline", "StableDiffusionXLPipeline", "StableDiffusion3Pipeline"})


class ImageParams(msgspec.Struct, tag="image", frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """prompt: the text; negative_prompt: what to steer away from (classifier-free guidance);
    n: how many images (image ``k`` uses seed ``seed + k``, so each is reproducible on its own);
    width/height: pixels, multiples of 8 (0: the model's default); num_inference_steps: denoising
    steps (0: default); guidance_scale: classifier-free guidance weight (≤ 1 turns guidance off);
    seed: the random seed of image 0 (None: the gateway picks one, so a retried stage redraws the
    same images). An edit (``POST /v1/images/edits``) also has ``image``, base64 PNG of the input at
    the output size, and optionally ``mask``, base64 PNG of a grey mask of the same size (white:
    repaint, black: keep; the gateway turns OpenAI's transparent areas into white); ``strength``
    is how far the input is noised before denoising (0: the pipeline's default, 0.8 for an
    image-to-image edit and 1.0 for an inpainting one)."""

    prompt: str
    negative_prompt: str = ""
    n: int = 1
    width: int = 0
    height: int = 0
    num_inference_steps: int = 0
    guidance_scale: float = 7.5
    seed: int | None = None
    image: str = ""
    mask: str = ""
    strength: float = 0.0

    def __post_init__(self) -> None:
        _check_type(self.prompt, str, "prompt")
        if not self.prompt.strip():
            raise InvalidParam("'prompt' must not be empty", param="prompt")
        if len(self.prompt) > MAX_PROMPT_CHARS:
            raise InvalidParam(f"'prompt' is longer than {MAX_PROMPT_CHARS} characters", param="prompt")
        _check_type(self.negative_prompt, str, "negative_prompt")
        if len(self.negative_prompt) > MAX_PROMPT_CHARS:
            raise InvalidParam(f"'negative_prompt' is longer than {MAX_PROMPT_CHARS} characters",
                             param="negative_prompt")
        _check_int(self.n, "n", 1, MAX_IMAGES)
        for name in ("width", "height"):
            value = getattr(self, name)
            _check_int(value, name, 0, MAX_SIDE, param="size")
            if value % SIZE_MULTIPLE:
                raise InvalidParam(f"'{name}' must be a multiple of {SIZE_MULTIPLE}, got {value}", param="size")
        if (self.width == 0) != (self.height == 0):
            raise InvalidParam("give both width and height, or neither", param="size")
        _check_int(self.num_inference_steps, "num_inference_steps", 0, MAX_STEPS)
        if isinstance(self.guidance_scale, bool) or not isinstance(self.guidance_scale, (int, float)) \
                or not math.isfinite(self.guidance_scale) or not 0 <= self.guidance_scale <= MAX_GUIDANCE:
            raise InvalidParam(f"'guidance_scale' must be a number between 0 and {MAX_GUIDANCE}",
                             param="guidance_scale")
        msgspec.structs.force_setattr(self, "guidance_scale", float(self.guidance_scale))
        if self.seed is not None:
            _check_int(self.seed, "seed", 0, MAX_SEED - MAX_IMAGES)
        _check_type(self.image, str, "image")
        _check_type(self.mask, str, "mask")
        if len(self.image) + len(self.mask) > MAX_EDIT_IMAGE_CHARS:
            raise InvalidParam(f"the image and mask take more than {MAX_EDIT_IMAGE_CHARS} base64 characters",
                             param="image")
        if self.mask and not self.image:
            raise InvalidParam("a mask needs an image", param="mask")
        if isinstance(self.strength, bool) or not isinstance(self.strength, (int, float)) \
                or not math.isfinite(self.strength) or not 0 <= self.strength <= 1:
            raise InvalidParam("'strength' must be a number between 0 and 1", param="strength")
        msgspec.structs.force_setattr(self, "strength", float(self.strength))

    def image_seed(self, index: int) -> int:
        """The seed of image ``index`` (requires a seed: the gateway always sets one)."""
        if self.seed is None:
            raise ValueError("no seed")
        return self.seed + index



def _check_type(value: Any, kind: type, name: str) -> None:
    if not isinstance(value, kind):
        raise InvalidParam(f"'{name}' must be a {kind.__name__}", param=name)


def _check_int(value: Any, name: str, lo: int, hi: int, param: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParam(f"'{name}' must be an integer", param=param or name)
    if not lo <= value <= hi:
        raise InvalidParam(f"'{name}' must be between {lo} and {hi}, got {value}", param=param or name)
