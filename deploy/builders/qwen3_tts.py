"""Build a tiny random-weight Qwen3-TTS 12 Hz CustomVoice directory (``omni-make-model tiny-qwen3-tts DIR``).

The layout is the real ``Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice``'s, written with the ``qwen_tts``
package's own classes (``workers/speech/qwen3_tts_package.py`` says which package and why), so the worker
loads it with the package's ``Qwen3TTSModel.from_pretrained`` exactly as it would load the real one::

    DIR/config.json, model.safetensors          Qwen3TTSConfig (model_type qwen3_tts, tts_model_type
                                                 custom_voice, tokenizer_type qwen3_tts_tokenizer_12hz):
                                                 a 2-layer talker (64 wide, M-RoPE) predicting
                                                 NUM_CODE_GROUPS codebooks per frame, the first
                                                 itself, the rest by a 1-layer code predictor
    DIR/generation_config.json                   the sampling defaults the package reads
                                                 (top-k 50, temperature 0.9, repetition penalty 1.05)
    DIR/tokenizer.json, tokenizer_config.json    tiny-llm's byte-level BPE + ChatML + <|tts_pad|>,
                                                 <|tts_bos|>, <|tts_eos|> (Qwen2TokenizerFast layout)
    DIR/speech_tokenizer/config.json,            the 12 Hz codec (Qwen3TTSTokenizerV2: a tiny Mimi
        model.safetensors,                       encoder and the decoder that turns NUM_CODE_GROUPS
        preprocessor_config.json                 codes per 1/12.5 s into 1920 samples at 24 kHz)

Speakers: :data:`SPEAKERS` (``talker_config.spk_id``; the voices ``/v1/audio/speech`` lists), no dialects;
languages: english and chinese (plus the package's "auto"). Weights are a pure function of ``seed``;
the codec's weights are drawn variance-preserving (and its codebooks filled) so random codes decode
to clearly audible samples.
"""

from __future__ import annotations

import json
import os
import pathlib

from omnirelay.deploy.builders.steps import build_seeded, has_files, padded_vocab, share_model_dir

MODEL_KIND = "tiny-qwen3-tts"
RECIPE_VERSION = 1
SPEAKERS = ("vivian", "ryan")
TTS_TOKENS = ["<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>"]
NUM_CODE_GROUPS = 4
HIDDEN = 64
SAMPLE_RATE = 24000
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "speech_tokenizer/config.json", "speech_tokenizer/model.safetensors",
                  "speech_tokenizer/preprocessor_config.json")
# The real checkpoint's codec-token layout: codes 0..2047, control tokens from 2148, speakers above.
CODEC = {"codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_think_id": 2154,
         "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157}
LANGUAGES = {"english": 2050, "chinese": 2055}
CODEC_GAIN = 1.0   # the codec's weights: std gain / sqrt(fan_in) (the default 0.02 decodes to near silence)
CODEC_OUT_SCALE = 0.01


def is_complete(path: str | os.PathLike) -> bool:
    return has_files(path, REQUIRED_FILES)


def _build_tokenizer(out: pathlib.Path):
    from transformers import PreTrainedTokenizerFast

    from omnirelay.deploy.builders.llm import CHAT_TEMPLATE
    from omnirelay.deploy.builders.llm import _build_tokenizer as build_base

    base = build_base(out)
    # One token, as in Qwen's vocabulary: the package cuts its prompt at fixed offsets (3 tokens of
    # "<|im_start|>assistant\n" before the text, 5 after it), which the tiny BPE would otherwise split.
    base.add_tokens(["assistant"])
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token=None, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token=None,
                                  additional_special_tokens=["<|im_start|>", *TTS_TOKENS],
                                  clean_up_tokenization_spaces=False, model_max_length=4096)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    # The real checkpoint names Qwen2's tokenizer class (the package's processor asks for it).
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return tok


def _tts_config(classes, tok):
    ids = {t: tok.convert_tokens_to_ids(t) for t in ["<|im_start|>", "<|im_end|>", *TTS_TOKENS]}
    text_vocab = padded_vocab(len(tok))
    predictor = dict(vocab_size=2048, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                     rope_theta=10000.0, num_code_groups=NUM_CODE_GROUPS, pad_token_id=None)
    talker = dict(code_predictor_config=predictor, vocab_size=3072, hidden_size=HIDDEN, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  max_position_embeddings=4096, rope_theta=10000.0,
                  rope_scaling={"rope_type": "default", "mrope_section": [4, 6, 6], "interleaved": True},
                  num_code_groups=NUM_CODE_GROUPS, text_hidden_size=HIDDEN, text_vocab_size=text_vocab,
                  position_id_per_seconds=13, codec_language_id=LANGUAGES,
                  spk_id={name: 3000 + i for i, name in enumerate(SPEAKERS)},
                  spk_is_dialect={name: False for name in SPEAKERS}, **CODEC)
    return classes.config(talker_config=talker, speaker_encoder_config={"enc_dim": HIDDEN},
                          tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size="0b6",
                          tts_model_type="custom_voice", im_start_token_id=ids["<|im_start|>"],
                          im_end_token_id=ids["<|im_end|>"], tts_pad_token_id=ids["<|tts_pad|>"],
                          tts_bos_token_id=ids["<|tts_bos|>"], tts_eos_token_id=ids["<|tts_eos|>"])


def _codec_config(classes):
    # A tiny Mimi encoder (12.5 frames/s: 24 kHz / (8·6·5·4·2)) and decoder (8·5·4·3 · 2·2 = 1920 samples a frame).
    encoder = dict(hidden_size=32, num_filters=8, num_residual_layers=1, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=16, intermediate_size=64, codebook_size=2048, codebook_dim=16,
                   num_quantizers=NUM_CODE_GROUPS, num_semantic_quantizers=1, vector_quantization_hidden_dimension=16,
                   sampling_rate=SAMPLE_RATE, frame_rate=12.5, upsampling_ratios=[8, 6, 5, 4], sliding_window=16,
                   max_position_embeddings=256, use_streaming=False, upsample_groups=32)
    decoder = dict(codebook_size=2048, codebook_dim=16, hidden_size=32, latent_dim=32, num_attention_heads=2,
                   num_key_value_heads=2, intermediate_size=64, num_hidden_layers=1, num_quantizers=NUM_CODE_GROUPS,
                   upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=32, sliding_window=16,
                   max_position_embeddings=1024)
    return classes.tokenizer_config(encoder_config=encoder, decoder_config=decoder,
                                    encoder_valid_num_quantizers=NUM_CODE_GROUPS, input_sample_rate=SAMPLE_RATE,
                                    output_sample_rate=SAMPLE_RATE, decode_upsample_rate=1920,
                                    encode_downsample_rate=1920)


def _save(model, out: pathlib.Path) -> None:
    """config.json + model.safetensors, as ``save_pretrained`` writes them. Not ``save_pretrained``
    itself: under transformers 5 it fails on the package's 4.x-style ``_tied_weights_keys`` lists
    (it expects dicts); nothing is tied here, so the state dict is the whole checkpoint."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def _save_codec(classes, out: pathlib.Path) -> None:
    """The 12 Hz codec's config and checkpoint, with the keys of the real one (``encoder.*``: transformers'
    Mimi model without its decoder half, as the package's ``Qwen3TTSTokenizerV2Encoder`` keeps it;
    ``decoder.*``: ``Qwen3TTSTokenizerV2Decoder``). Built part by part: the package's whole
    ``Qwen3TTSTokenizerV2Model`` cannot be constructed under transformers 5 (workers/speech/qwen3_tts_package.py)."""
    import torch
    from safetensors.torch import save_file
    from transformers import MimiModel

    config = _codec_config(classes)
    encoder = MimiModel(config.encoder_config)
    decoder = classes.codec_decoder._from_config(config.decoder_config).float()
    for name, param in decoder.named_parameters():
        if name.endswith("_codebook.embedding_sum"):   # initialised to zeros (k-means learns them)
            param.normal_(0.0, 1.0)
    for module in decoder.modules():   # variance-preserving, so random codes come out audible
        if isinstance(module, torch.nn.Linear):
            fan_in = module.weight.shape[1]
        elif isinstance(module, torch.nn.Conv1d):
            fan_in = module.weight[0].numel()
        elif isinstance(module, torch.nn.ConvTranspose1d):   # each output sums in_channels · kernel / stride
            fan_in = module.weight.shape[0] * module.weight.shape[2] // module.stride[0]
        else:
            continue
        module.weight.normal_(0.0, CODEC_GAIN / fan_in ** 0.5)
    decoder.decoder[-1].conv.weight.mul_(CODEC_OUT_SCALE)   # the waveform at ~0.4 rms, rarely clipped
    state = {f"encoder.{k}": v for k, v in encoder.state_dict().items()
             if not k.startswith(("upsample.", "decoder_transformer.", "decoder."))}
    state.update({f"decoder.{k}": v for k, v in decoder.state_dict().items()})
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})


def _build_into(out: pathlib.Path, seed: int) -> None:
    import torch
    from transformers import EncodecFeatureExtractor

    from omnirelay.workers.speech.qwen3_tts_package import load_classes

    classes = load_classes()
    tok = _build_tokenizer(out)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = classes.model(_tts_config(classes, tok)).to(torch.float32).eval()
        _save(model, out)
        # As the real config.json has it: the speaker encoder's config class takes no other keys (the
        # generic to_dict adds model_type & co, which it would refuse on load).
        path = out / "config.json"
        written = json.loads(path.read_text())
        written["speaker_encoder_config"] = {"enc_dim": HIDDEN, "sample_rate": SAMPLE_RATE}
        # transformers 5 writes ``rope_parameters``; the package's talker reads ``rope_scaling`` (which
        # the real checkpoint has, written by 4.x), and from rope_parameters alone it would get None.
        talker = written["talker_config"]
        talker["rope_scaling"] = {"rope_type": "default", "mrope_section": [4, 6, 6], "interleaved": True}
        talker.pop("rope_parameters", None)
        path.write_text(json.dumps(written, indent=2) + "\n")
        _save_codec(classes, out / "speech_tokenizer")
    EncodecFeatureExtractor(feature_size=1, sampling_rate=SAMPLE_RATE, padding_value=0.0).save_pretrained(
        str(out / "speech_tokenizer"))
    # generation_config.json as the real checkpoint has it: the package's generate() defaults.
    (out / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05,
         "subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0, "subtalker_temperature": 0.9,
         "max_new_tokens": 8192}, indent=2) + "\n")
    share_model_dir(out)


def build_tiny_qwen3_tts(path: str | os.PathLike, seed: int = 0, *, force: bool = False) -> pathlib.Path:
    """Write the tiny Qwen3-TTS model to ``path`` (atomically, see ``llm.build_atomically``)."""
    return build_seeded(path, _build_into, seed, force=force, complete=is_complete, what="Qwen3-TTS model")


def cached_tiny_qwen3_tts() -> pathlib.Path:
    """The cached seed-0 build (tests share it)."""
    from omnirelay.deploy.builders.llm import cached_model
    return cached_model(f"{MODEL_KIND}-v{RECIPE_VERSION}-seed0", lambda tmp: _build_into(tmp, 0), is_complete)
