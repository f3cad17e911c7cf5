"""Image edits on a served text-to-image pipeline: its own components, run as diffusers' image-to-image
pipeline (an edit without a mask) or inpainting pipeline (with one), built once with ``from_pipe``
(no weights are loaded or copied).

An edit item carries its input image (and mask) as base64 PNG at the output size
(:class:`~omnirelay.image_params.ImageParams`); :class:`EditRunner` decodes them and runs one
pipeline call per batch in one engine step, like the whole-call runner, with one seeded generator
per image, so an edit is reproducible from its seed. Items batch together only with the same kind
(masked or not), size, steps, guidance and strength.

Which pipelines can edit: those diffusers maps to an image-to-image and an inpainting class
(:data:`~omnirelay.image_params.EDITABLE_PIPELINES`, the Stable Diffusion families); the gateway answers 422 for any other
before submitting, and the engine refuses one that reached it anyway.
"""

from __future__ import annotations

import base64
import io

import torch

from omnirelay.errors import BadRequest
from omnirelay.image_params import EDITABLE_PIPELINES
IMG2IMG_STRENGTH = 0.8     # diffusers' default for an image-to-image call
INPAINT_STRENGTH = 1.0     # … and for an inpainting one


def can_edit(pipe) -> bool:
    return type(pipe).__name__ in EDITABLE_PIPELINES


def decode_png(data: str, mode: str):
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(data))) as image:
        return image.convert(mode)


class EditRunner:
    """Runs edit batches through the image-to-image or inpainting form of ``pipe``."""

    def __init__(self, pipe):
        if not can_edit(pipe):
            raise BadRequest(f"{type(pipe).__name__} cannot edit images", param="model")
        self.pipe = pipe
        self._img2img = None
        self._inpaint = None

    def _pipeline(self, masked: bool):
        from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting

        if masked:
            if self._inpaint is None:
                self._inpaint = AutoPipelineForInpainting.from_pipe(self.pipe)
            return self._inpaint
        if self._img2img is None:
            self._img2img = AutoPipelineForImage2Image.from_pipe(self.pipe)
        return self._img2img

    @staticmethod
    def strength(item) -> float:
        return item.strength or (INPAINT_STRENGTH if item.mask else IMG2IMG_STRENGTH)

    def batch_key(self, item) -> tuple:
        return "edit", bool(item.mask), item.width, item.height, item.steps, item.guidance_scale, self.strength(item)

    @torch.inference_mode()
    def advance(self, batch) -> list:
        items = batch.items
        head = items[0]
        kwargs = dict(prompt=[it.prompt for it in items], image=[decode_png(it.image, "RGB") for it in items],
                      strength=self.strength(head), num_inference_steps=head.steps,
                      guidance_scale=head.guidance_scale,
                      generator=[torch.Generator().manual_seed(it.seed) for it in items], output_type="pil")
        if head.mask:
            kwargs.update(mask_image=[decode_png(it.mask, "L") for it in items], width=head.width,
                          height=head.height)
        if any(it.negative_prompt for it in items):
            kwargs["negative_prompt"] = [it.negative_prompt for it in items]
        return list(self._pipeline(bool(head.mask))(**kwargs).images)

    def keep_rows(self, batch, rows: list[int]) -> None:
        batch.items = [batch.items[i] for i in rows]
