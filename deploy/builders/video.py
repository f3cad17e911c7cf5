"""Build a tiny random-weight diffusers text-to-video pipeline (``omni-make-model tiny-video DIR``).

The result is an ordinary diffusers directory, loadable offline with
``DiffusionPipeline.from_pretrained(DIR)`` (it resolves to ``TextToVideoSDPipeline``, the
ModelScope text-to-video design)::

    DIR/model_index.json              the pipeline class and its components
    DIR/unet/                         UNet3DConditionModel: 2 levels (32, 64 channels), spatial and
                                      temporal attention, cross-attention on the prompt
    DIR/vae/                          AutoencoderKL (per frame): 4 levels, 8 pixels per latent
    DIR/scheduler/                    DDIMScheduler with Stable Diffusion's schedule (deterministic)
    DIR/text_encoder/                 CLIPTextModel: 2 layers, 64 wide, 77 positions
    DIR/tokenizer/                    CLIP tokenizer files, built offline by :mod:`.tiny_diffusers`

Why this pipeline class: of the text-to-video pipelines diffusers 0.42 ships, it is the one that
loads and runs on a CPU-only install without ``accelerate`` (Wan, LTX and CogVideoX transformers
pin modules to float32, which diffusers refuses to load without it), it reuses the CLIP tokenizer
the image builder already trains offline, and a 16-frame 64×64 clip of 4 steps takes ~2 s on one
core. diffusers marks it deprecated (a warning at load), but it is still exported and loads with
``DiffusionPipeline``.

The native output is 64×64 (an 8×8 latent per frame) and 16 frames; any multiple of 8 pixels and
any frame count work. Only the UNet and the pipeline class are this module's own; everything else
(the seeding, the widened VAE output, the atomic write) is :mod:`.tiny_diffusers`', shared with the
text-to-image builder.
"""

from __future__ import annotations

import os
import pathlib

from omnirelay.deploy.builders.tiny_diffusers import UNetPipeline, build, is_complete

MODEL_KIND = "tiny-video"
NATIVE_FRAMES = 16
__all__ = ["build_tiny_text_to_video", "is_complete"]


RECIPE = UNetPipeline("UNet3DConditionModel", "TextToVideoSDPipeline", "3D")


def build_tiny_text_to_video(path: str | os.PathLike, seed: int = 0, *, force: bool = False) -> pathlib.Path:
    """Write the tiny pipeline to ``path`` and return it (atomically, as the LLM builder does)."""
    return build(path, RECIPE, seed, force)
