"""Build a tiny random-weight diffusers text-to-image pipeline (``omni-make-model tiny-sd DIR``).

The result is an ordinary diffusers directory, loadable offline with
``DiffusionPipeline.from_pretrained(DIR)`` (it resolves to ``StableDiffusionPipeline``)::

    DIR/model_index.json              the pipeline class and its components
    DIR/unet/                         UNet2DConditionModel: 2 levels (32, 64 channels), cross-attention
    DIR/vae/                          AutoencoderKL: 4 levels, so 8 pixels per latent (SD's factor)
    DIR/scheduler/                    DDIMScheduler with Stable Diffusion's schedule (deterministic)
    DIR/text_encoder/                 CLIPTextModel: 2 layers, 64 wide, 77 positions
    DIR/tokenizer/                    CLIPTokenizer files: vocab.json, merges.txt, tokenizer_config.json

The default output is 64×64 (an 8×8 latent); any multiple of 8 pixels works. At 64×64 one
denoising step takes ~10 ms on one CPU core, a whole 50-step image well under a second.

Only the UNet and the pipeline class are this module's own; the tokenizer (trained offline), the
text encoder, VAE and scheduler, the seeding and the atomic write are :mod:`.tiny_diffusers`',
shared with the text-to-video builder.
"""

from __future__ import annotations

import os
import pathlib

from omnirelay.deploy.builders.tiny_diffusers import UNetPipeline, build, is_complete

MODEL_KIND = "tiny-sd"
RECIPE_VERSION = 1
__all__ = ["build_tiny_text_to_image", "is_complete"]


RECIPE = UNetPipeline("UNet2DConditionModel", "StableDiffusionPipeline", "2D",
                      dict(safety_checker=None, feature_extractor=None, requires_safety_checker=False))


def build_tiny_text_to_image(path: str | os.PathLike, seed: int = 0, *, force: bool = False) -> pathlib.Path:
    """Write the tiny pipeline to ``path`` and return it (atomically, as the LLM builder does)."""
    return build(path, RECIPE, seed, force)
