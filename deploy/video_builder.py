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
    DIR/tokenizer/                    CLIP tokenizer files, built offline by :mod:`.diffusion_builder`

Why this pipeline class: of the text-to-video pipelines diffusers 0.42 ships, it is the one that
loads and runs on a CPU-only install without ``accelerate`` (Wan, LTX and CogVideoX transformers
pin modules to float32, which diffusers refuses to load without it), it reuses the CLIP tokenizer
the image builder already trains offline, and a 16-frame 64×64 clip of 4 steps takes ~2 s on one
core. diffusers marks it deprecated (a warning at load), but it is still exported and loads with
``DiffusionPipeline``.

The native output is 64×64 (an 8×8 latent per frame) and 16 frames; any multiple of 8 pixels and
any frame count work. Weights are a pure function of ``seed`` (each component under its own
seeded RNG; the caller's global RNG is untouched) and the VAE decoder's output layer is widened so
that frames are not a flat grey. Everything is written into a temporary sibling directory and
renamed into place, as in :mod:`omnirelay.deploy.model_builder`.
"""

from __future__ import annotations

import os
import pathlib
import shutil

from .diffusion_builder import MAX_TEXT_POSITIONS, TEXT_WIDTH, VAE_OUT_STD, _write_tokenizer

MODEL_KIND = "tiny-video"
REQUIRED_FILES = ("model_index.json", "unet/config.json", "vae/config.json", "scheduler/scheduler_config.json",
                  "text_encoder/config.json", "tokenizer/vocab.json", "tokenizer/merges.txt")
NATIVE_FRAMES = 16


def _build_into(out: pathlib.Path, seed: int) -> None:
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, TextToVideoSDPipeline, UNet3DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab_size = _write_tokenizer(out / "tokenizer")
    tokenizer = CLIPTokenizer.from_pretrained(str(out / "tokenizer"))
    text_config = CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=TEXT_WIDTH, intermediate_size=4 * TEXT_WIDTH, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=MAX_TEXT_POSITIONS, projection_dim=TEXT_WIDTH,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    # One seed per component (as in the image builder): a change to one recipe leaves the others' weights.
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(text_config).eval()
        torch.manual_seed(seed + 1)
        unet = UNet3DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
            up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), cross_attention_dim=TEXT_WIDTH,
            attention_head_dim=8, norm_num_groups=8).eval()
        torch.manual_seed(seed + 2)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
            block_out_channels=(16, 16, 32, 32), down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=8, sample_size=64).eval()
        vae.decoder.conv_out.weight.normal_(0.0, VAE_OUT_STD, generator=torch.Generator().manual_seed(seed + 3))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    pipe = TextToVideoSDPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                 scheduler=scheduler)
    saved_tokenizer = {p.name: p.read_bytes() for p in (out / "tokenizer").iterdir()}
    pipe.save_pretrained(str(out), safe_serialization=True)
    # Keep exactly the CLIP tokenizer files written above (save_pretrained rewrites them in the
    # library's current format), as the image builder does.
    shutil.rmtree(out / "tokenizer")
    (out / "tokenizer").mkdir()
    for name, data in saved_tokenizer.items():
        (out / "tokenizer" / name).write_bytes(data)
    for path in [out, *out.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def is_complete(path: str | os.PathLike) -> bool:
    root = pathlib.Path(path)
    return all((root / name).is_file() for name in REQUIRED_FILES)


def build_tiny_text_to_video(path: str | os.PathLike, seed: int = 0, *, force: bool = False) -> pathlib.Path:
    """Write the tiny pipeline to ``path`` and return it (atomically, as the LLM builder does)."""
    from .model_builder import build_atomically
    return build_atomically(path, lambda tmp: _build_into(tmp, seed), force=force, complete=is_complete,
                            what="pipeline")
