"""What the tiny diffusers builders (:mod:`.stable_diffusion`, :mod:`.video`) share: the
tokenizer, text encoder, VAE and scheduler around their UNet, and the writing of the directory.

Both write an ordinary diffusers directory, loadable offline with
``DiffusionPipeline.from_pretrained(DIR)``::

    DIR/model_index.json              the pipeline class and its components
    DIR/unet/                         the builder's UNet: 2 levels (32, 64 channels), cross-attention
    DIR/vae/                          AutoencoderKL: 4 levels, so 8 pixels per latent (SD's factor)
    DIR/scheduler/                    DDIMScheduler with Stable Diffusion's schedule (deterministic)
    DIR/text_encoder/                 CLIPTextModel: 2 layers, 64 wide, 77 positions
    DIR/tokenizer/                    CLIPTokenizer files: vocab.json, merges.txt, tokenizer_config.json

The tokenizer is CLIP's byte-level BPE with ``</w>`` word ends, trained here with ``tokenizers`` on
:data:`CORPUS` (no download) and written in CLIP's own file format: the 256 byte symbols, the same
with ``</w>``, then one entry per merge, then ``<|startoftext|>`` and ``<|endoftext|>`` — so
``CLIPTokenizer.from_pretrained(DIR/tokenizer)`` loads it, fast or slow.

Weights are a pure function of ``seed``: each component is built under its own seeded RNG (the
caller's global RNG is untouched), and the VAE decoder's output layer is widened so that images are
not a flat grey — different seeds and prompts give visibly different pictures.

Everything is written into a temporary sibling directory and renamed into place, as in
:mod:`omnirelay.deploy.builders.llm`. :mod:`omnirelay.deploy.embedded` names its cache entries
after this module's source too, so a change here rebuilds both pipelines.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

from omnirelay.deploy.builders.steps import build_seeded, has_files, save_pipeline, seeded_parts, widen_vae_output

REQUIRED_FILES = ("model_index.json", "unet/config.json", "vae/config.json", "scheduler/scheduler_config.json",
                  "text_encoder/config.json", "tokenizer/vocab.json", "tokenizer/merges.txt")

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
MAX_TEXT_POSITIONS = 77          # CLIP's context, which diffusers pads every prompt to
TEXT_WIDTH = 64
BPE_MERGES = 700                 # at most this many merges (the corpus yields ~370; vocab = 512 + merges + 2)
VAE_OUT_STD = 0.1                # std of the VAE decoder's last conv: spreads pixels over [0, 255]

# What the prompts in tests and demos talk about: enough words that merges are not trivial.
CORPUS = """\
a photograph of a red fox sitting in the snow at dawn, soft light, high detail
an oil painting of a lighthouse on a rocky coast during a storm, dramatic waves
a watercolor sketch of a quiet village street with bicycles and flower pots
a cat wearing a tiny astronaut helmet floating among stars and planets
a bowl of ramen with a soft boiled egg, green onions and steam rising
a futuristic city skyline at night with neon signs reflected in the rain
an illustration of a dragon curled around a mountain, golden scales, clouds
a close up of a dew drop on a green leaf, macro photography, bokeh background
a cozy reading corner with a wooden chair, a lamp, plants and many books
a map of an imaginary island with forests, rivers, castles and a harbor
portrait of an old sailor with a white beard and a blue knitted hat
a minimalist poster of a sunrise over the desert, orange and purple tones
a robot watering tomatoes in a small garden behind a brick house
low quality, blurry, distorted, watermark, text, cropped, worst quality
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible map from bytes to printable characters (the byte-level alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _train_clip_bpe() -> tuple[dict[str, int], list[str]]:
    """Learn merges on CORPUS with CLIP's normalisation and splitting; return (vocab, merges) in
    CLIP's order."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    alphabet = sorted(_bytes_to_unicode().values(), key=ord)
    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    # The same pipeline transformers' CLIPTokenizer builds, so the merges apply to what it produces.
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                           normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|"""
                                   r"""[\p{N}]|[^\s\p{L}\p{N}]+"""), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=10_000, min_frequency=1, initial_alphabet=alphabet,
                                  end_of_word_suffix="</w>", show_progress=False, limit_alphabet=len(alphabet))
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    learned = json.loads(tok.to_str())["model"]["merges"]   # ["a", "b"] pairs; "a b" strings before tokenizers 0.20
    merges = [pair if isinstance(pair, str) else " ".join(pair) for pair in learned][:BPE_MERGES]
    vocab: dict[str, int] = {}
    for symbol in alphabet + [c + "</w>" for c in alphabet]:
        vocab[symbol] = len(vocab)
    for merge in merges:
        vocab.setdefault(merge.replace(" ", ""), len(vocab))
    vocab[BOS] = len(vocab)
    vocab[EOS] = len(vocab)
    return vocab, merges


def _write_tokenizer(out: pathlib.Path) -> int:
    vocab, merges = _train_clip_bpe()
    out.mkdir(parents=True)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": EOS, "pad_token": EOS}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "CLIPTokenizer", "model_max_length": MAX_TEXT_POSITIONS, "do_lower_case": True,
         "clean_up_tokenization_spaces": False, **special}, indent=2) + "\n")
    return len(vocab)


# The UNet's shape; its block types follow from the recipe's dimensionality (2D images, 3D video).
UNET_SHAPE = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                  cross_attention_dim=TEXT_WIDTH, attention_head_dim=8, norm_num_groups=8)


@dataclasses.dataclass(frozen=True)
class UNetPipeline:
    """What one builder of this module's pipelines chooses. The diffusers classes go by name, so
    diffusers is imported only when a build runs; ``dims`` is the UNet's ("2D" for images, "3D" for
    video): cross-attention on its first level down and its last level up."""
    unet_class: str
    pipeline_class: str
    dims: str
    pipeline_options: dict[str, Any] = dataclasses.field(default_factory=dict)


def clip_text_setup(out: pathlib.Path, width: int):
    """Write the CLIP tokenizer into ``out/tokenizer``; return it loaded and the config of a 2-layer,
    ``width``-wide CLIP text encoder over its vocabulary."""
    from transformers import CLIPTextConfig, CLIPTokenizer

    vocab_size = _write_tokenizer(out / "tokenizer")
    tokenizer = CLIPTokenizer.from_pretrained(str(out / "tokenizer"))
    text_config = CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=MAX_TEXT_POSITIONS, projection_dim=width,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    return tokenizer, text_config


def write_pipeline(out: pathlib.Path, seed: int, recipe: UNetPipeline) -> None:
    """Write the whole pipeline into ``out``: the recipe's UNet between the shared components, saved
    as its pipeline class."""
    import diffusers
    from diffusers import AutoencoderKL, DDIMScheduler
    from transformers import CLIPTextModel

    unet_class, dims = getattr(diffusers, recipe.unet_class), recipe.dims
    blocks = dict(down_block_types=(f"CrossAttnDownBlock{dims}", f"DownBlock{dims}"),
                  up_block_types=(f"UpBlock{dims}", f"CrossAttnUpBlock{dims}"))
    tokenizer, text_config = clip_text_setup(out, TEXT_WIDTH)
    text_encoder, unet, vae = seeded_parts(
        seed, lambda: CLIPTextModel(text_config).eval(), lambda: unet_class(**UNET_SHAPE, **blocks).eval(),
        lambda: AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
            block_out_channels=(16, 16, 32, 32), down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=8, sample_size=64).eval())
    widen_vae_output(vae, VAE_OUT_STD, seed + 3)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    pipe = getattr(diffusers, recipe.pipeline_class)(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                                     unet=unet, scheduler=scheduler, **recipe.pipeline_options)
    save_pipeline(pipe, out, clip_tokenizers=("tokenizer",))


def is_complete(path: str | os.PathLike) -> bool:
    return has_files(path, REQUIRED_FILES)


def build(path: str | os.PathLike, recipe: UNetPipeline, seed: int, force: bool) -> pathlib.Path:
    """Write ``recipe``'s pipeline atomically into ``path`` (as the LLM builder does); returns ``path``."""
    return build_seeded(path, lambda tmp, seed: write_pipeline(tmp, seed, recipe), seed, force=force,
                        complete=is_complete, what="pipeline")
