"""Build a tiny random-weight Qwen3-Omni directory (``omni-make-model tiny-qwen3-omni DIR``).

Where it sits in a request's life: nowhere at serving time. Tests, demos and CI call it once to get
a ``Qwen3OmniMoeForConditionalGeneration`` checkpoint that every stage loads offline with the real
transformers classes: the gateway reads the tokenizer, chat template and the audio/image processor
settings; the encode worker the thinker's vision encoder (with its DeepStack mergers) and audio
encoder; prefill/decode the thinker's MoE language model; the generate worker the talker (MoE
talker + multi-codebook code predictor) and code2wav.

API (stable; the serving code and tests build on it)::

    from omnirelay.deploy.builders.qwen3_omni import build_tiny_qwen3_omni, SPEAKERS
    path = build_tiny_qwen3_omni(DIR, seed=0, force=False)      # -> pathlib.Path, built atomically
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(DIR)   # thinker + talker + code2wav
    thinker = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(DIR)   # weights under thinker.*
    tokenizer = AutoTokenizer.from_pretrained(DIR)             # .image_token, .audio_token, ...
    WhisperFeatureExtractor.from_pretrained(DIR)               # 128 mels, 16 kHz
    Qwen2VLImageProcessorPil.from_pretrained(DIR)              # patch 16, merge 2 (Qwen3-VL's)

Directory layout::

    DIR/config.json               Qwen3OmniMoeConfig (model_type qwen3_omni_moe), enable_audio_output
                                  true; talker_config.speaker_id names the voices (no pickle: unlike
                                  Qwen2.5-Omni the speakers are codec token ids, not tensors)
    DIR/generation_config.json    greedy; eos = <|im_end|>, <|endoftext|>
    DIR/model.safetensors         thinker.model.{visual,audio_tower,language_model}.*, thinker.lm_head.*,
                                  talker.*, code2wav.*  (keys exactly as transformers saves them)
    DIR/tokenizer.json, tokenizer_config.json, chat_template.jinja
                                  the tiny-llm BPE plus "user"/"assistant"/"system" as single tokens
                                  (the talker's prompt layout counts "<|im_start|>assistant\\n" as 3
                                  tokens, as the real vocabulary has it) and the Qwen3-Omni special
                                  tokens; media parts -> <|vision_start|><|image_pad|><|vision_end|>,
                                  <|audio_start|><|audio_pad|><|audio_end|>
    DIR/preprocessor_config.json  WhisperFeatureExtractor (128 mels, 16 kHz, 30 s window) and the Qwen2-VL
                                  image processor (patch 16, merge 2, 64..256 px per side), one file
    DIR/spk_dict.json             {"<Name>": {"speaker_id": codec id}} -- the voices, for the gateway

Sizes: the thinker's LM is a 4-layer, 256-wide Qwen3-MoE (4 query / 2 KV heads, head_dim 64, q/k
RMSNorm, 4 experts, top-2, MoE intermediate 128, interleaved M-RoPE sections [12, 10, 10] in the real
[24, 20, 20] proportions); vision encoder 2 blocks x 64 wide, DeepStack after blocks 0 and 1; audio
encoder 2 layers x 64 wide; talker 2 layers x 64 wide MoE with a 2-layer code predictor over 4
codebooks; code2wav 2 layers x 64 wide, 1920 samples per code at 24 kHz. Loading + one forward is
well under a second on a CPU.

Weights are a pure function of ``seed`` (the caller's RNG is untouched); the thinker's LM uses tiny-llm's
per-module init (``llm.INIT_STD``, the experts like the dense MLP, routers wide enough that
tokens pick different experts) so greedy text is non-degenerate; the encoders' output projections are
scaled up so an image or audio clip visibly changes the answer; code2wav's convolutions keep PyTorch's
own init scale so its waveform is not silence. Every parameter is written from ``seed``: the talker's
experts, which transformers' init skips, are drawn here too (tests/engine/test_builders_deterministic.py).
"""

from __future__ import annotations

import json
import os
import pathlib

from omnirelay.deploy.builders.steps import (build_seeded, has_files, omni_chat_template, omni_tokenizer, padded_vocab, reset_convs,
                            share_model_dir, write_omni_model, write_omni_processor)

MODEL_KIND = "tiny-qwen3-omni"
SPEAKERS = ("Ethan", "Chelsie")      # Ethan first: transformers' default speaker
ROLE_WORDS = ["user", "assistant", "system"]
OMNI_TOKENS = ["<|audio_start|>", "<|audio_end|>", "<|audio_pad|>", "<|vision_start|>", "<|vision_end|>",
               "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"]
NAMED_TOKENS = {"image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>",
                "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
                "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "preprocessor_config.json", "spk_dict.json")
CHAT_TEMPLATE = omni_chat_template(NAMED_TOKENS)
HIDDEN = 256
MROPE_SECTION = [12, 10, 10]     # interleaved: H on columns 1,4,..; W on 2,5,..; T on the rest (of 32)
PATCH = 16
MIN_PIXELS, MAX_PIXELS = 64 * 64, 256 * 256   # 2x2 .. 8x8 merged tokens per image
AUDIO_CHUNK_SECONDS = 30
ENCODER_OUT_STD = 0.5
ROUTER_STD = 0.5
TALKER_EXPERT_STD = 0.02     # transformers' initializer_range, which its init leaves out for these
NUM_CODE_GROUPS = 4
CODEBOOK = 2048
TALKER_VOCAB = 3072               # codec ids 0..2047, specials above; generate() suppresses 2048..3071 but EOS
CODEC = {"codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_nothink_id": 2155,
         "codec_think_bos_id": 2156, "codec_think_eos_id": 2157}
SPEAKER_IDS = {"ethan": 2301, "chelsie": 2302}


def _build_tokenizer(out: pathlib.Path):
    # The role words are plain (not special) single tokens, as in the real vocabulary.
    tok = omni_tokenizer(out, OMNI_TOKENS, NAMED_TOKENS, CHAT_TEMPLATE, plain_words=tuple(ROLE_WORDS))
    for word in ROLE_WORDS:
        if len(tok.encode(word, add_special_tokens=False)) != 1:
            raise RuntimeError(f"{word!r} must be one token")
    return tok


def _config(tok, vocab_size: int):
    from transformers import Qwen3OmniMoeConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *OMNI_TOKENS,
                                                      *ROLE_WORDS]}
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": MROPE_SECTION,
            "interleaved": True}
    text = dict(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                rms_norm_eps=1e-6, rope_parameters=rope, tie_word_embeddings=False, attention_bias=False,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=1,
                norm_topk_prob=True, mlp_only_layers=[], use_sliding_window=False,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, in_channels=3, patch_size=PATCH,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=HIDDEN, num_position_embeddings=64,
                  deepstack_visual_indexes=[0, 1])
    audio = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=128, d_model=64,
                 max_source_positions=1500, n_window=50, n_window_infer=400, conv_chunksize=500,
                 downsample_hidden_size=32, output_dim=HIDDEN)
    thinker = dict(text_config=text, vision_config=vision, audio_config=audio,
                   audio_token_id=ids["<|audio_pad|>"], image_token_id=ids["<|image_pad|>"],
                   video_token_id=ids["<|video_pad|>"], audio_start_token_id=ids["<|audio_start|>"],
                   audio_end_token_id=ids["<|audio_end|>"], vision_start_token_id=ids["<|vision_start|>"],
                   vision_end_token_id=ids["<|vision_end|>"], user_token_id=ids["user"], position_id_per_seconds=13,
                   bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                   pad_token_id=ids["<|endoftext|>"])
    talker_text = dict(vocab_size=TALKER_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [6, 5, 5],
                                        "interleaved": True},
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=False,
                       mlp_only_layers=[], decoder_sparse_step=1, shared_expert_intermediate_size=64)
    predictor = dict(vocab_size=CODEBOOK, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
                     num_code_groups=NUM_CODE_GROUPS, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    talker = dict(text_config=talker_text, code_predictor_config=predictor, num_code_groups=NUM_CODE_GROUPS,
                  thinker_hidden_size=HIDDEN, accept_hidden_layer=2, speaker_id=SPEAKER_IDS,
                  audio_token_id=ids["<|audio_pad|>"], image_token_id=ids["<|image_pad|>"],
                  video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                  audio_start_token_id=ids["<|audio_start|>"], position_id_per_seconds=13, spatial_merge_size=2,
                  **CODEC)
    code2wav = dict(codebook_size=CODEBOOK, hidden_size=64, max_position_embeddings=8000, num_attention_heads=2,
                    num_key_value_heads=2, sliding_window=72, intermediate_size=128, num_hidden_layers=2,
                    num_quantizers=NUM_CODE_GROUPS, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
                    decoder_dim=64)
    config = Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
                                enable_audio_output=True, im_start_token_id=ids["<|im_start|>"],
                                im_end_token_id=ids["<|im_end|>"], tts_pad_token_id=ids["<tts_pad>"],
                                tts_bos_token_id=ids["<tts_text_bos>"], tts_eos_token_id=ids["<tts_text_eod>"],
                                system_token_id=ids["system"], user_token_id=ids["user"],
                                assistant_token_id=ids["assistant"])
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    return config, ids


def _init_weights(model, seed: int, real_vocab: int, special_ids: set[int]) -> None:
    """Overwrite the random init so the thinker's greedy text is non-degenerate (tiny-llm's recipe)."""
    import torch

    from omnirelay.deploy.builders.llm import INIT_STD

    gen = torch.Generator().manual_seed(seed)
    thinker = model.thinker
    lm = thinker.model.language_model
    for name, param in thinker.named_parameters():
        parts = name.split(".")
        module, kind = parts[-2], parts[-1]
        if not ("language_model" in parts or parts[0] == "lm_head"):
            continue
        if module in INIT_STD and kind == "weight":
            param.normal_(0.0, INIT_STD[module], generator=gen)
        elif module == "experts":   # batched experts: [E, 2I, H] gate+up, [E, H, I] down
            param.normal_(0.0, INIT_STD["gate_proj" if kind == "gate_up_proj" else "down_proj"], generator=gen)
        elif module == "gate" and kind == "weight":   # the router: wide, so tokens pick different experts
            param.normal_(0.0, ROUTER_STD, generator=gen)
    visual = thinker.model.visual
    visual.merger.mlp[2].weight.normal_(0.0, ENCODER_OUT_STD / 8, generator=gen)
    for merger in visual.merger_list:
        merger.mlp[2].weight.normal_(0.0, ENCODER_OUT_STD / 8, generator=gen)
    thinker.model.audio_tower.proj2.weight.normal_(0.0, ENCODER_OUT_STD, generator=gen)
    thinker.lm_head.weight[real_vocab:].zero_()
    # Special tokens other than <|im_end|> get logit 0, so greedy text neither stops at once on
    # <|endoftext|> nor emits media placeholders; <|im_end|> can still end a reply.
    thinker.lm_head.weight[sorted(special_ids)] = 0.0
    lm.embed_tokens.weight[real_vocab:].zero_()
    _init_speech(model, gen)


def _init_speech(model, gen) -> None:
    """Make the random talker + code2wav speak something a test can hear: code2wav at HF's 0.02 init
    outputs near-silence; PyTorch's own conv init (``reset_parameters``' bound) keeps the scale."""
    # transformers' _init_weights (5.x) covers the thinker's batched experts but not the talker's: they stay
    # torch.empty, i.e. whatever memory held before (zeros on a fresh heap, NaN-producing garbage elsewhere).
    for name, param in model.talker.named_parameters():
        if ".experts." in f".{name}":
            param.normal_(0.0, TALKER_EXPERT_STD, generator=gen)
    reset_convs(model.code2wav.modules(), gen)


def _write_processor(out: pathlib.Path) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH,
                                     temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
                                     image_std=[0.5, 0.5, 0.5])
    write_omni_processor(out, image, "Qwen3OmniMoeProcessor", AUDIO_CHUNK_SECONDS)


def _build_into(out: pathlib.Path, seed: int) -> None:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    tok = _build_tokenizer(out)
    config, ids = _config(tok, padded_vocab(len(tok)))
    specials = {i for t, i in ids.items() if t not in ("<|im_end|>", *ROLE_WORDS)}
    write_omni_model(out, seed, Qwen3OmniMoeForConditionalGeneration, config, ids,
                     lambda model: _init_weights(model, seed, len(tok), specials))
    _write_processor(out)
    voices = {name: {"speaker_id": SPEAKER_IDS[name.lower()]} for name in SPEAKERS}
    (out / "spk_dict.json").write_text(json.dumps(voices, indent=2, sort_keys=True) + "\n")
    share_model_dir(out)


def is_complete(path: str | os.PathLike) -> bool:
    return has_files(path, REQUIRED_FILES)


def build_tiny_qwen3_omni(path: str | os.PathLike, seed: int = 0, *, force: bool = False) -> pathlib.Path:
    """Write the tiny Qwen3-Omni to ``path`` and return it (atomically, as the LLM builder does)."""
    return build_seeded(path, _build_into, seed, force=force, complete=is_complete, what="model")
