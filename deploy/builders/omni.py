"""Build a tiny random-weight Qwen2.5-Omni directory (``omni-make-model tiny-omni DIR``).

Where it sits in a request's life: nowhere at serving time. Tests, demos and CI call it once to get a
model that every omni stage can load offline -- the gateway reads the tokenizer, chat template and the
audio/image processor configs; the encode worker loads the thinker's vision and audio encoders; the
prefill/decode workers load the thinker's language model; the speech stages load the talker and
token2wav (with the speaker table below).

API (stable; the speech helper and the tests build on it)::

    from omnirelay.deploy.builders.omni import build_tiny_omni, load_full_model, load_speakers, SPEAKERS
    path = build_tiny_omni(DIR, seed=0, force=False)   # -> pathlib.Path, built atomically
    speakers = load_speakers(DIR)   # {"Chelsie": {"cond": (1, 192) f32, "ref_mel": (1, 30, 80) f32,
                                    #              "bos_token": int}, "Ethan": {...}}
    model = load_full_model(DIR)    # Qwen2_5OmniForConditionalGeneration (thinker + talker +
                                    # token2wav), speaker_map already filled from the two spk files
    thinker = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(DIR)
    talker = Qwen2_5OmniTalkerForConditionalGeneration / Qwen2_5OmniToken2WavModel: take them from
             load_full_model(DIR).talker / .token2wav (their weights live under talker.* / token2wav.*)
    tokenizer = AutoTokenizer.from_pretrained(DIR)          # .image_token, .audio_token_id, ...
    WhisperFeatureExtractor.from_pretrained(DIR)            # audio features (128 mels, 16 kHz)
    Qwen2VLImageProcessorPil.from_pretrained(DIR)           # (transformers.models.qwen2_vl.
                                                            #  image_processing_pil_qwen2_vl)

Directory layout::

    DIR/config.json                  Qwen2_5OmniConfig (model_type qwen2_5_omni), enable_audio_output true
    DIR/generation_config.json       greedy; eos = <|im_end|>, <|endoftext|>
    DIR/model.safetensors            all weights: thinker.model.{visual,audio_tower,language_model}.*,
                                     thinker.lm_head.*, talker.*, token2wav.{code2wav_dit_model,
                                     code2wav_bigvgan_model}.*  (keys exactly as transformers saves them)
    DIR/spk_dict.safetensors         speaker tensors "<Name>.cond", "<Name>.ref_mel" (no pickle)
    DIR/spk_dict.json                {"<Name>": {"bos_token": id}}  -- thinker-vocab ids of the
                                     speaker's talker text-bos token (<|tts_bos_<name>|>)
    DIR/tokenizer.json, tokenizer_config.json, chat_template.jinja
                                     the tiny-llm BPE plus the Omni special tokens; the named ones
                                     (tokenizer.image_token, .audio_token, .vision_bos_token, ...) as
                                     in the real tokenizer_config; a ChatML template whose content
                                     parts image/image_url -> <|vision_bos|><|IMAGE|><|vision_eos|>,
                                     audio/input_audio/audio_url -> <|audio_bos|><|AUDIO|><|audio_eos|>
    DIR/preprocessor_config.json     WhisperFeatureExtractor (128 mels, 16 kHz, 30 s window) and the
                                     Qwen2VL image processor (patch 14, merge 2, 56..224 px per side),
                                     one file, as in the real checkpoint

Speakers: :data:`SPEAKERS` = ("Chelsie", "Ethan"), "Chelsie" first (transformers' default speaker).
The real checkpoint ships ``spk_dict.pt`` (a torch pickle); we never write or read pickles, so
``Qwen2_5OmniForConditionalGeneration.from_pretrained(DIR)`` itself raises OSError (it insists on that
file) -- use :func:`load_full_model`, which runs the same loading without it and fills
``speaker_map`` via :func:`load_speakers`. ``Qwen2_5OmniProcessor.from_pretrained(DIR)`` needs
torchvision (for its video processor, which we do not use); load its pieces directly as above.

Sizes: the thinker's LM is a 4-layer, 256-wide Qwen2 (4 query / 2 KV heads, head_dim 64, M-RoPE
sections [8, 12, 12]); vision encoder 2 blocks x 64 wide -> 256; audio encoder 2 layers x 64 wide ->
256; talker 2 layers x 64 wide; DiT 2 layers x 64; BigVGAN 128 initial channels, dilations
[[1,3,5]]*3. About 20 MB of float32 in all; loading + one forward is well under a second on a CPU.

Token ids: our BPE vocabulary is ~1.5k tokens; the Omni special tokens are appended after it in the
real checkpoint's order, and every config field that names a token id (audio/image/video token,
vision/audio bos, tts text bos/eos/pad, speaker bos) points at *our* ids.

Weights are a pure function of ``seed`` (the caller's RNG is untouched) and the thinker's LM uses
tiny-llm's per-module init (``llm.INIT_STD``) so greedy text is non-degenerate; the
encoders' output projections are scaled up so an image or audio clip visibly changes the answer.
"""

from __future__ import annotations

import json
import os
import pathlib

from omnirelay.deploy.builders.steps import (build_seeded, has_files, omni_chat_template, omni_tokenizer, padded_vocab, reset_convs,
                            share_model_dir, write_omni_model, write_omni_processor)

MODEL_KIND = "tiny-omni"
RECIPE_VERSION = 1
SPEAKERS = ("Chelsie", "Ethan")
# The Qwen2.5-Omni special tokens, in the real checkpoint's order (151646...), then our speaker and
# tts tokens (real ids sit in the reserved range; we name them so they survive in the tokenizer).
OMNI_TOKENS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|box_end|>", "<|quad_start|>",
               "<|quad_end|>", "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>", "<|IMAGE|>",
               "<|VIDEO|>"]
TTS_TOKENS = ["<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>"] + [f"<|tts_bos_{s.lower()}|>" for s in SPEAKERS]
NAMED_TOKENS = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
                "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "preprocessor_config.json", "spk_dict.safetensors", "spk_dict.json")
CHAT_TEMPLATE = omni_chat_template(NAMED_TOKENS)
HIDDEN = 256
MROPE_SECTION = [8, 12, 12]          # sums to head_dim / 2 = 32, in the real [16, 24, 24] proportions
# Image processor bounds: 28 px per merged token, so 2x2 .. 8x8 tokens per image.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 224 * 224
AUDIO_CHUNK_SECONDS = 30             # Whisper window the feature extractor pads to (real: 300)
ENCODER_OUT_STD = 0.5                # std of the encoders' output projections (see the docstring)
REF_MEL_FRAMES = 30
SPEAKER_COND_DIM = 192


def _build_tokenizer(out: pathlib.Path):
    # The tiny-llm BPE + ChatML tokens; the Omni tokens are appended after it.
    return omni_tokenizer(out, [*OMNI_TOKENS, *TTS_TOKENS], NAMED_TOKENS, CHAT_TEMPLATE)


def _config(tok, vocab_size: int):
    from transformers import Qwen2_5OmniConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in ["<|endoftext|>", "<|im_end|>", *OMNI_TOKENS, *TTS_TOKENS]}
    user_id = tok.encode("user", add_special_tokens=False)[0]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE_SECTION}
    text = dict(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_parameters=rope, tie_word_embeddings=False, use_sliding_window=False,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, in_channels=3, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, out_hidden_size=HIDDEN,
                  fullatt_block_indexes=[1])
    audio = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=128, d_model=64,
                 max_source_positions=1500, n_window=100, output_dim=HIDDEN)
    thinker = dict(text_config=text, vision_config=vision, audio_config=audio,
                   audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"],
                   video_token_index=ids["<|VIDEO|>"], audio_start_token_id=ids["<|audio_bos|>"],
                   audio_end_token_id=ids["<|audio_eos|>"], vision_start_token_id=ids["<|vision_bos|>"],
                   vision_end_token_id=ids["<|vision_eos|>"], vision_token_id=ids["<|vision_pad|>"],
                   user_token_id=user_id, position_id_per_seconds=25, seconds_per_chunk=2,
                   bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                   pad_token_id=ids["<|endoftext|>"])
    talker = dict(vocab_size=8448, embedding_size=HIDDEN, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                 "mrope_section": [4, 6, 6]},
                  audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"],
                  video_token_index=ids["<|VIDEO|>"], vision_start_token_id=ids["<|vision_bos|>"],
                  vision_end_token_id=ids["<|vision_eos|>"], audio_start_token_id=ids["<|audio_bos|>"],
                  audio_end_token_id=ids["<|audio_eos|>"], tts_text_start_token_id=ids["<|tts_bos|>"],
                  tts_text_end_token_id=ids["<|tts_eos|>"], tts_text_pad_token_id=ids["<|tts_pad|>"],
                  tts_codec_start_token_id=8293, tts_codec_end_token_id=8294, tts_codec_pad_token_id=8292,
                  tts_codec_mask_token_id=8296, spatial_merge_size=2, use_sliding_window=False)
    dit = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=32, ff_mult=2, emb_dim=32,
               block_size=24, look_ahead_layers=[1], look_backward_layers=[0, 1], repeats=2, num_embeds=8193,
               mel_dim=80, dropout=0.0, enc_emb_dim=SPEAKER_COND_DIM, enc_dim=32,
               enc_channels=[64, 64, 64, 64, 192], enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
               enc_attention_channels=16, enc_res2net_scale=2, enc_se_channels=16)
    # Three dilation lists, one per resblock kernel size (BigVGAN zips the two).
    bigvgan = dict(mel_dim=80, upsample_initial_channel=128, resblock_kernel_sizes=[3, 7, 11],
                   resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
                   upsample_rates=[5, 3, 2, 2, 2, 2], upsample_kernel_sizes=[11, 7, 4, 4, 4, 4])
    config = Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker,
                               token2wav_config={"dit_config": dit, "bigvgan_config": bigvgan},
                               enable_audio_output=True)
    config.architectures = ["Qwen2_5OmniForConditionalGeneration"]
    return config, ids


def _init_weights(model, seed: int, real_vocab: int, special_ids: set[int]) -> None:
    """Overwrite the random init so the thinker's greedy text is non-degenerate (tiny-llm's recipe)."""
    import torch

    from omnirelay.deploy.builders.llm import BIAS_STD, INIT_STD

    gen = torch.Generator().manual_seed(seed)
    thinker = model.thinker
    for name, param in thinker.named_parameters():
        parts = name.split(".")
        module, kind = parts[-2], parts[-1]
        in_lm = "language_model" in parts or parts[0] == "lm_head"
        if in_lm and module in INIT_STD and kind == "weight":
            param.normal_(0.0, INIT_STD[module], generator=gen)
        elif in_lm and kind == "bias":
            param.normal_(0.0, BIAS_STD, generator=gen)
    # The encoders' last projections feed the LM's residual stream; at HF's 0.02 their output would be
    # noise next to unit-scale token embeddings and media would not change the answer.
    thinker.model.visual.merger.mlp[2].weight.normal_(0.0, ENCODER_OUT_STD / 8, generator=gen)
    thinker.model.audio_tower.proj.weight.normal_(0.0, ENCODER_OUT_STD, generator=gen)
    thinker.lm_head.weight[real_vocab:].zero_()
    # Special tokens other than <|im_end|> get logit 0 (far below the usual max), so greedy text does
    # not stop at once on <|endoftext|> or emit media placeholders; <|im_end|> can still end a reply.
    thinker.lm_head.weight[sorted(special_ids)] = 0.0   # (advanced indexing: assign, not .zero_())
    thinker.model.language_model.embed_tokens.weight[real_vocab:].zero_()
    _init_speech(model, gen)


def _init_speech(model, gen) -> None:
    """Make the random talker + token2wav speak something a test can hear. (1) The talker's codec
    vocabulary (8448) is larger than token2wav's code embedding (``num_embeds`` 8193, as in the real
    checkpoint, whose trained talker never emits the rest): zero the rows above it, so their logit is
    exactly 0 and top-k 40 of 8192 random logits never reaches them (the codec EOS ids are among them:
    the talker speaks until ``max_new_tokens``). (2) BigVGAN at HF's 0.02 init outputs ~1e-7, silence
    in 16-bit PCM; PyTorch's own conv init keeps the scale (RMS ~0.1, unclipped)."""
    codes = model.config.token2wav_config.dit_config.num_embeds
    model.talker.codec_head.weight[codes:].zero_()
    reset_convs(model.token2wav.code2wav_bigvgan_model.modules(), gen)


def _write_speakers(out: pathlib.Path, ids: dict, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed + 7)
    tensors, meta = {}, {}
    for name in SPEAKERS:
        tensors[f"{name}.cond"] = torch.randn(1, SPEAKER_COND_DIM, generator=gen)
        tensors[f"{name}.ref_mel"] = torch.randn(1, REF_MEL_FRAMES, 80, generator=gen)
        meta[name] = {"bos_token": ids[f"<|tts_bos_{name.lower()}|>"]}
    save_file(tensors, str(out / "spk_dict.safetensors"))
    (out / "spk_dict.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def load_full_model(path: str | os.PathLike, **kwargs):
    """``Qwen2_5OmniForConditionalGeneration`` from ``path`` with ``speaker_map`` filled from our files.

    The class's own ``from_pretrained`` insists on the real checkpoint's ``spk_dict.pt`` (a torch
    pickle, which we never write); the parent's ``from_pretrained`` does everything else the same."""
    from transformers import Qwen2_5OmniForConditionalGeneration as Omni

    model = super(Omni, Omni).from_pretrained(str(path), **kwargs)
    model.speaker_map.update(load_speakers(path))
    return model


def load_speakers(path: str | os.PathLike) -> dict[str, dict]:
    """The speaker table in transformers' ``speaker_map`` shape: name -> {cond, ref_mel, bos_token},
    read the way the speech worker reads it."""
    from omnirelay.workers.speech.loading import load_speakers as read_speaker_table

    return read_speaker_table(pathlib.Path(path))


def _write_processor(out: pathlib.Path) -> None:
    """The audio and image settings in one file, as the real checkpoint has them. (No
    Qwen2_5OmniProcessor object here: its video processor needs torchvision, which the serving path
    never uses.)"""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14,
                                     temporal_patch_size=2, merge_size=2)
    write_omni_processor(out, image, "Qwen2_5OmniProcessor", AUDIO_CHUNK_SECONDS)


def _build_into(out: pathlib.Path, seed: int) -> None:
    from transformers import Qwen2_5OmniForConditionalGeneration

    tok = _build_tokenizer(out)
    config, ids = _config(tok, padded_vocab(len(tok)))
    specials = {i for t, i in ids.items() if t != "<|im_end|>"}
    write_omni_model(out, seed, Qwen2_5OmniForConditionalGeneration, config, ids,
                     lambda model: _init_weights(model, seed, len(tok), specials))
    _write_processor(out)
    _write_speakers(out, ids, seed)
    share_model_dir(out)


def is_complete(path: str | os.PathLike) -> bool:
    return has_files(path, REQUIRED_FILES)


def build_tiny_omni(path: str | os.PathLike, seed: int = 0, *, force: bool = False) -> pathlib.Path:
    """Write the tiny Qwen2.5-Omni to ``path`` and return it (atomically, as the LLM builder does)."""
    return build_seeded(path, _build_into, seed, force=force, complete=is_complete, what="model")
