"""Steps the tiny-model builders take alike: seeding each component, padding the vocabulary, the
Omni tokenizer and processor files, saving a pipeline, and the atomic, world-readable directory.

One place for each step keeps the families' recipes from drifting apart where they mean the same
thing. Every step consumes random numbers exactly as the builders did before it moved here, so the
weights stay a pure function of the seed and unchanged by the move. :mod:`omnirelay.deploy.embedded`
names the cache entries of the builders that use this module after its source too.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any, Callable, Iterable


def padded_vocab(size: int) -> int:
    """``size`` rounded up to a multiple of 64: embedding matrices are padded the way real checkpoints are."""
    return -(-size // 64) * 64


def has_files(path: str | os.PathLike, names: Iterable[str]) -> bool:
    """Whether every one of ``names`` is a file under ``path`` (a builder's "is this complete" test)."""
    root = pathlib.Path(path)
    return all((root / name).is_file() for name in names)


def build_seeded(path: str | os.PathLike, build_into: Callable[[pathlib.Path, int], None], seed: int, *,
                 force: bool, complete: Callable, what: str) -> pathlib.Path:
    """``build_into(tmp, seed)`` atomically into ``path`` (see ``llm.build_atomically``)."""
    from omnirelay.deploy.builders.llm import build_atomically
    return build_atomically(path, lambda tmp: build_into(tmp, seed), force=force, complete=complete, what=what)


def share_model_dir(out: pathlib.Path) -> None:
    # mkdtemp made the dir private; a model dir is shared data.
    for path in [out, *out.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def seeded_parts(seed: int, *makers: Callable[[], Any]) -> list[Any]:
    """``makers[i]()`` under ``torch.manual_seed(seed + i)``: one seed per component, so a change to
    one recipe leaves the others' weights alone; the caller's global RNG is untouched (fork_rng)."""
    import torch

    parts = []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for offset, make in enumerate(makers):
            torch.manual_seed(seed + offset)
            parts.append(make())
    return parts


def widen_vae_output(vae, std: float, seed: int) -> None:
    """Redraw the VAE decoder's last conv with ``std`` from its own generator: at the library's init
    every decoded pixel sits near mid-grey, and pictures of different prompts look alike."""
    import torch

    with torch.no_grad():
        vae.decoder.conv_out.weight.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))


def save_pipeline(pipe, out: pathlib.Path, clip_tokenizers: tuple[str, ...] = ()) -> None:
    """Save a diffusers pipeline as safetensors and open the directory to all readers. The CLIP
    tokenizer files already in ``out/tokenizer`` are kept byte for byte in each of ``clip_tokenizers``:
    save_pretrained rewrites tokenizers in the library's current format, which older transformers
    cannot read; the files written by hand every version reads."""
    kept = {p.name: p.read_bytes() for p in (out / "tokenizer").iterdir()} if clip_tokenizers else {}
    pipe.save_pretrained(str(out), safe_serialization=True)
    for name in clip_tokenizers:
        shutil.rmtree(out / name, ignore_errors=True)
        (out / name).mkdir()
        for file_name, data in kept.items():
            (out / name / file_name).write_bytes(data)
    share_model_dir(out)


def state_native_size(out: pathlib.Path, size: tuple[int, int]) -> None:
    """Write a pipeline directory's own native size (width, height) into its ``model_index.json``
    (:func:`omnirelay.dit_families.family_of_dir` reads it; diffusers ignores underscore keys)."""
    from omnirelay.dit_families import NATIVE_SIZE_KEY

    path = out / "model_index.json"
    index = json.loads(path.read_text())
    index[NATIVE_SIZE_KEY] = list(size)
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def omni_tokenizer(out: pathlib.Path, specials: list[str], named_tokens: dict[str, str], chat_template: str,
                   plain_words: tuple[str, ...] = ()):
    """The tiny-llm BPE with ``plain_words`` added as ordinary tokens and ``<|im_start|>`` plus
    ``specials`` appended as special tokens (``named_tokens`` name some of them, as the real
    tokenizer_config does), saved into ``out`` over the base tokenizer's files."""
    from transformers import PreTrainedTokenizerFast

    from omnirelay.deploy.builders.llm import _build_tokenizer as build_base

    base = build_base(out)
    if plain_words:
        base.add_tokens(list(plain_words))
    base.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *specials]},
                            replace_extra_special_tokens=True)
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token=None,
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
                                  additional_special_tokens=["<|im_start|>", *specials],
                                  extra_special_tokens=named_tokens, clean_up_tokenization_spaces=False,
                                  model_max_length=4096)
    tok.chat_template = chat_template
    tok.save_pretrained(str(out))
    return tok


def write_omni_model(out: pathlib.Path, seed: int, model_class: type, config, ids: dict[str, int],
                     init_weights: Callable[[Any], None]) -> None:
    """``model_class(config)`` in float32 seeded by ``seed`` (the caller's RNG untouched), then
    ``init_weights(model)``; saved greedy, stopping on ``<|im_end|>`` or ``<|endoftext|>``."""
    import torch
    from transformers import GenerationConfig

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32).eval()
        init_weights(model)
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=ids["<|endoftext|>"], do_sample=False)
    model.save_pretrained(str(out), safe_serialization=True)


def reset_convs(modules: Iterable, gen) -> None:
    """Redraw every 1-D (transposed) convolution among ``modules`` with PyTorch's own bound
    (``reset_parameters``'), from ``gen``: a vocoder at the HF 0.02 init outputs near-silence."""
    import torch

    for module in modules:
        if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            bound = 1.0 / (module.weight.shape[1] * module.weight.shape[2]) ** 0.5
            module.weight.uniform_(-bound, bound, generator=gen)
            if module.bias is not None:
                module.bias.uniform_(-bound, bound, generator=gen)


def write_omni_processor(out: pathlib.Path, image_processor, processor_class: str, audio_chunk_seconds: int) -> None:
    """One preprocessor_config.json holding both the image settings (``image_processor``'s) and a
    Whisper feature extractor's (128 mels, 16 kHz), as the real checkpoints have it; each class
    reads its own keys."""
    from transformers import WhisperFeatureExtractor

    audio = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160,
                                    chunk_length=audio_chunk_seconds, n_fft=400, return_attention_mask=True)
    merged = {**json.loads(image_processor.to_json_string()), **json.loads(audio.to_json_string())}
    merged.pop("mel_filters", None)   # recomputed from the sizes on load; 100 kB of floats otherwise
    merged.update(image_processor_type="Qwen2VLImageProcessor", feature_extractor_type="WhisperFeatureExtractor",
                  processor_class=processor_class)
    (out / "preprocessor_config.json").write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")


def omni_chat_template(named_tokens: dict[str, str]) -> str:
    """ChatML whose media parts become bos + one placeholder + eos, with the tokens ``named_tokens``
    names (the processor or gateway expands the placeholder to one token per feature): the real Omni
    templates' structure, without their default system prompt."""
    def media(kind: str, bos: str, eos: str) -> str:
        return "{{ '" + named_tokens[bos] + named_tokens[kind] + named_tokens[eos] + "' }}"

    vision, audio = ("vision_bos_token", "vision_eos_token"), ("audio_bos_token", "audio_eos_token")
    return (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for content in message['content'] %}"
        "{% if content['type'] == 'image' or content['type'] == 'image_url' %}"
        + media("image_token", *vision) +
        "{% elif content['type'] == 'audio' or content['type'] == 'input_audio' or content['type'] == 'audio_url' %}"
        + media("audio_token", *audio) +
        "{% elif content['type'] == 'video' %}" + media("video_token", *vision) +
        "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
