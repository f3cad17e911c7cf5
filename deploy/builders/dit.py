"""Build a tiny random-weight diffusion-transformer text-to-image pipeline (``omni-make-model tiny-dit DIR``).

The result is an ordinary diffusers directory, loadable offline with
``DiffusionPipeline.from_pretrained(DIR)`` (it resolves to ``StableDiffusion3Pipeline``)::

    DIR/model_index.json              the pipeline class and its components
    DIR/transformer/                  SD3Transformer2DModel (MMDiT): 2 joint blocks, 4 heads × 8, patch 2
    DIR/vae/                          AutoencoderKL: 4 levels, so 8 pixels per latent; shift factor 0
    DIR/scheduler/                    FlowMatchEulerDiscreteScheduler (shift 3, as SD3; deterministic)
    DIR/text_encoder/, text_encoder_2/  CLIPTextModelWithProjection: 2 layers, 32 wide, 77 positions
    DIR/text_encoder_3/               T5EncoderModel: 2 layers, 64 wide (relative positions, any length)
    DIR/tokenizer/, _2/, _3/          the same CLIP tokenizer files, built offline by :mod:`.tiny_diffusers`

Why this pipeline: it is the diffusers text-to-image pipeline around a diffusion *transformer*
whose attention the sequence-parallel kernel (:mod:`omnirelay.workers.generate.sequence_parallel`) splits,
and it runs on a CPU-only install without ``accelerate``. SD3 has three text encoders: two CLIPs
and a T5. All three use the CLIP tokenizer the SD builder trains offline (the T5 encoder reads any
token ids of its vocabulary; a T5 sentencepiece tokenizer would need a download or sentencepiece
training). The T5 is kept, rather than saved as ``null`` (which the pipeline tolerates), because
``DiffusionPipeline.from_pretrained`` refuses a directory with a null component unless the caller
passes it explicitly — the directory must load with a plain ``from_pretrained``.

Shapes: the two CLIP encoders' hidden states (32 + 32) fill ``joint_attention_dim`` 64 (the
T5's width) and their pooled projections ``pooled_projection_dim`` 64. The native output is 64×64: an 8×8 latent, so
(8/2)² = 16 image tokens — divisible by sequence-parallel sizes 1, 2, 4, 8 and 16; 128×128 has 64.
``pos_embed_max_size`` 32 allows up to 512×512. Each prompt brings 77 + 256 text tokens (CLIP,
then T5 at the pipeline's default ``max_sequence_length``), which every sequence-parallel rank holds whole.

Weights are a pure function of ``seed`` (each component under its own seeded RNG; the caller's
global RNG is untouched) and the VAE decoder's output layer is widened so that images are not a
flat grey. Everything is written into a temporary sibling directory and renamed into place, as in
:mod:`omnirelay.deploy.builders.llm`.
"""

from __future__ import annotations

import os
import pathlib

from omnirelay.deploy.builders.steps import build_seeded, has_files, save_pipeline, seeded_parts, widen_vae_output
from omnirelay.deploy.builders.tiny_diffusers import VAE_OUT_STD, clip_text_setup

MODEL_KIND = "tiny-dit"
REQUIRED_FILES = ("model_index.json", "transformer/config.json", "vae/config.json",
                  "scheduler/scheduler_config.json", "text_encoder/config.json", "text_encoder_2/config.json",
                  "text_encoder_3/config.json", "tokenizer/vocab.json", "tokenizer_2/vocab.json",
                  "tokenizer_3/vocab.json")
CLIP_WIDTH = 32                  # each CLIP encoder; the transformer's text width is twice this
LATENT_SIZE = 8                  # native latent side: 64×64 pixels


def _build_into(out: pathlib.Path, seed: int) -> None:
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizer, text_config = clip_text_setup(out, CLIP_WIDTH)
    t5_config = T5Config(vocab_size=text_config.vocab_size, d_model=2 * CLIP_WIDTH, d_kv=16, d_ff=4 * CLIP_WIDTH,
                         num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                         relative_attention_max_distance=64, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    # One seed per component (as in the SD builder): a change to one recipe leaves the others' weights.
    text_encoder, text_encoder_2, text_encoder_3, transformer, vae = seeded_parts(
        seed, lambda: CLIPTextModelWithProjection(text_config).eval(),
        lambda: CLIPTextModelWithProjection(text_config).eval(), lambda: T5EncoderModel(t5_config).eval(),
        lambda: SD3Transformer2DModel(
            sample_size=LATENT_SIZE, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
            attention_head_dim=8, num_attention_heads=4, joint_attention_dim=2 * CLIP_WIDTH,
            caption_projection_dim=32, pooled_projection_dim=2 * CLIP_WIDTH, pos_embed_max_size=32,
            qk_norm="rms_norm").eval(),
        lambda: AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
            block_out_channels=(16, 16, 32, 32), down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=8, sample_size=64,
            shift_factor=0.0).eval())   # SD3's pipeline shifts latents by it; None would fail there
    widen_vae_output(vae, VAE_OUT_STD, seed + 5)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae,
                                    text_encoder=text_encoder, tokenizer=tokenizer,
                                    text_encoder_2=text_encoder_2, tokenizer_2=tokenizer,
                                    text_encoder_3=text_encoder_3, tokenizer_3=tokenizer)
    save_pipeline(pipe, out, clip_tokenizers=("tokenizer", "tokenizer_2", "tokenizer_3"))


def is_complete(path: str | os.PathLike) -> bool:
    return has_files(path, REQUIRED_FILES)


def build_tiny_dit(path: str | os.PathLike, seed: int = 0, *, force: bool = False) -> pathlib.Path:
    """Write the tiny pipeline to ``path`` and return it (atomically, as the LLM builder does)."""
    return build_seeded(path, _build_into, seed, force=force, complete=is_complete, what="pipeline")
