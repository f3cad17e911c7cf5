"""Build a tiny random-weight Z-Image text-to-image pipeline (``omni-make-model tiny-zimage DIR``).

The result is an ordinary diffusers directory shaped like ``Tongyi-MAI/Z-Image-Turbo``, loadable
offline with ``DiffusionPipeline.from_pretrained(DIR)`` (it resolves to ``ZImagePipeline``)::

    DIR/model_index.json       the pipeline class and its components
    DIR/transformer/           ZImageTransformer2DModel: single-stream DiT, 2 layers + 1 refiner layer
                               each side, 4 heads × 16, patch 2, 3-axis RoPE (4 + 6 + 6)
    DIR/vae/                   AutoencoderKL: 16 latent channels (Flux's VAE shape), 4 levels, so 8
                               pixels per latent; Flux's scaling and shift factors
    DIR/scheduler/             FlowMatchEulerDiscreteScheduler (shift 3, as Z-Image-Turbo)
    DIR/text_encoder/          Qwen3Model: 3 layers, 64 wide (the pipeline reads its second-to-last
                               hidden states, so the transformer's caption width is 64)
    DIR/tokenizer/             a byte-level BPE tokenizer with a ChatML template (the pipeline wraps
                               each prompt in a chat turn), trained offline by
                               :func:`omnirelay.deploy.builders.llm._build_tokenizer`

Sizes: the VAE's 8 pixels per latent times the transformer's 2×2 patches make images in multiples
of 16 pixels (what ``ZImagePipeline`` itself demands). A 64×64 image is a 8×8 latent, 16 image
tokens; the caption adds its own tokens (padded to a multiple of 32 inside the transformer).

Weights are a pure function of ``seed`` (each component under its own seeded RNG; the caller's
global RNG is untouched), and the VAE decoder's output layer is widened so that images are not a
flat grey. Everything is written into a temporary sibling directory and renamed into place, as in
:mod:`omnirelay.deploy.builders.llm`.
"""

from __future__ import annotations

import os
import pathlib

from omnirelay.deploy.builders.steps import build_seeded, has_files, padded_vocab, save_pipeline, seeded_parts, widen_vae_output
from omnirelay.deploy.builders.tiny_diffusers import VAE_OUT_STD

MODEL_KIND = "tiny-zimage"
REQUIRED_FILES = ("model_index.json", "transformer/config.json", "vae/config.json",
                  "scheduler/scheduler_config.json", "text_encoder/config.json", "tokenizer/tokenizer.json")
TEXT_WIDTH = 64
LATENT_CHANNELS = 16


def _transformer():
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=LATENT_CHANNELS, dim=64, n_layers=2,
        n_refiner_layers=1, n_heads=4, n_kv_heads=4, cap_feat_dim=TEXT_WIDTH, rope_theta=256.0,
        t_scale=1000.0, axes_dims=[4, 6, 6], axes_lens=[1024, 128, 128]).eval()


def _build_into(out: pathlib.Path, seed: int) -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline
    from transformers import Qwen3Config, Qwen3Model

    from omnirelay.deploy.builders.llm import _build_tokenizer

    tokenizer = _build_tokenizer(out / "tokenizer")
    text_config = Qwen3Config(
        vocab_size=padded_vocab(len(tokenizer)), hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    text_encoder, transformer, vae = seeded_parts(
        seed, lambda: Qwen3Model(text_config).eval(), _transformer,
        lambda: AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, layers_per_block=1,
            block_out_channels=(16, 16, 32, 32), down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=8, sample_size=64,
            scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False).eval())
    widen_vae_output(vae, VAE_OUT_STD, seed + 3)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    save_pipeline(ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                 transformer=transformer), out)


def is_complete(path: str | os.PathLike) -> bool:
    return has_files(path, REQUIRED_FILES)


def build_tiny_zimage(path: str | os.PathLike, seed: int = 0, *, force: bool = False) -> pathlib.Path:
    """Write the tiny pipeline to ``path`` and return it (atomically, as the LLM builder does)."""
    return build_seeded(path, _build_into, seed, force=force, complete=is_complete, what="pipeline")
