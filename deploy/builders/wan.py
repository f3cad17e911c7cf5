"""Build a tiny random-weight Wan 2.2 text-to-video pipeline (``omni-make-model tiny-wan DIR``).

The result is an ordinary diffusers directory shaped like ``Wan-AI/Wan2.2-T2V-A14B-Diffusers``,
loadable offline with ``DiffusionPipeline.from_pretrained(DIR)`` (it resolves to ``WanPipeline``)::

    DIR/model_index.json       the pipeline class, its components and boundary_ratio 0.875
    DIR/transformer/           WanTransformer3DModel (the high-noise expert): 2 blocks, 2 heads × 16,
                               patch (1, 2, 2), 3-axis RoPE, cross-attention on the prompt
    DIR/transformer_2/         the same shape, other weights (the low-noise expert: A14B switches
                               to it once the timestep falls below boundary_ratio × 1000)
    DIR/vae/                   AutoencoderKLWan: causal 3D VAE, 8 pixels and 4 frames per latent
    DIR/scheduler/             UniPCMultistepScheduler over flow sigmas (flow_shift 3, as Wan 480p)
    DIR/text_encoder/          UMT5EncoderModel: 2 layers, 32 wide
    DIR/tokenizer/             byte-level BPE tokenizer (any ids the UMT5 vocabulary holds),
                               trained offline by :func:`omnirelay.deploy.builders.llm._build_tokenizer`

Sizes: 8 pixels per latent times the 2×2 patch make sides in multiples of 16; frames come as
4·k + 1 (the VAE keeps the first frame and packs 4 per latent after it). A 64×64, 9-frame clip is
a 3 × 8 × 8 latent, 48 video tokens.

Native size: :data:`NATIVE_SIZE` (416×240, half of Wan's 832×480 a side), stated in
``model_index.json`` (:data:`omnirelay.dit_families.NATIVE_SIZE_KEY`) for the gateway's default.
At Wan's own 832×480, a default request (65 frames) is 26,520 tokens: each of the 100 forwards of
50 guided steps then spends 97% of its time in self-attention over them (2 heads × 16 dims, so the
softmax of 703 M scores per head, not the matmuls, sets the cost), about 7.5 s a step on one core,
and the causal VAE decodes 65 full-size frames after that — over 8 minutes for a random-weight
test model. A quarter of the tokens makes attention 16× cheaper and keeps the aspect ratio.

The transformers pin their norms and embeddings to float32 (``_keep_in_fp32_modules``); diffusers
loads them without ``accelerate`` as well. Weights are a pure function of ``seed`` (each component
under its own seeded RNG; the caller's global RNG is untouched). The VAE's decoder output is
widened so that frames are not a flat grey. Written into a temporary sibling directory and renamed
into place, as in :mod:`omnirelay.deploy.builders.llm`.
"""

from __future__ import annotations

import os
import pathlib

from omnirelay.deploy.builders.steps import (build_seeded, has_files, padded_vocab, save_pipeline, seeded_parts,
                                             state_native_size, widen_vae_output)

MODEL_KIND = "tiny-wan"
REQUIRED_FILES = ("model_index.json", "transformer/config.json", "transformer_2/config.json", "vae/config.json",
                  "scheduler/scheduler_config.json", "text_encoder/config.json", "tokenizer/tokenizer.json")
TEXT_WIDTH = 32
VAE_OUT_STD = 0.5
NATIVE_SIZE = (416, 240)


def _transformer():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
        text_dim=TEXT_WIDTH, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=256).eval()


def _build_into(out: pathlib.Path, seed: int) -> None:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    from omnirelay.deploy.builders.llm import _build_tokenizer

    tokenizer = _build_tokenizer(out / "tokenizer")
    text_config = UMT5Config(
        vocab_size=padded_vocab(len(tokenizer)), d_model=TEXT_WIDTH, d_kv=8, d_ff=2 * TEXT_WIDTH, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=64,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    text_encoder, transformer, transformer_2, vae = seeded_parts(
        seed, lambda: UMT5EncoderModel(text_config).eval(), _transformer, _transformer,
        lambda: AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, True, True]).eval())
    widen_vae_output(vae, VAE_OUT_STD, seed + 4)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        num_train_timesteps=1000)
    save_pipeline(WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                              transformer=transformer, transformer_2=transformer_2, boundary_ratio=0.875), out)
    state_native_size(out, NATIVE_SIZE)


def is_complete(path: str | os.PathLike) -> bool:
    return has_files(path, REQUIRED_FILES)


def build_tiny_wan(path: str | os.PathLike, seed: int = 0, *, force: bool = False) -> pathlib.Path:
    """Write the tiny pipeline to ``path`` and return it (atomically, as the LLM builder does)."""
    return build_seeded(path, _build_into, seed, force=force, complete=is_complete, what="pipeline")
