"""Qwen3-Omni end to end on the tiny random-weight model (``omni-make-model tiny-qwen3-omni``).

The reference is transformers: ``Qwen3OmniMoeThinkerForConditionalGeneration.generate`` (greedy) on
the same directory, its inputs built by transformers' own preprocessors and token-count rules. So
the gateway's placeholder expansion, the encode worker's encoders (DeepStack features included),
the prefill's embedding merge, interleaved M-RoPE and DeepStack addition, the compact MoE thinker
and decode's rope delta must all agree with transformers for the greedy tokens to match.

Served by ``omni-serve DIR`` alone: the directory's kind (``qwen3-omni``) picks the bundled pipeline.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import wave

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from omnirelay.deploy.builders.qwen3_omni import build_tiny_qwen3_omni
from omnirelay.deploy.served_models import bundled_pipeline
from omnirelay.model_kind import model_kind

from conftest import ServeProcess
from media_support import audio_part, image_part, random_png, thinker_reference, wav_bytes
from omni_engine_support import decode_prefilled, encode_then_prefill
from repo_paths import REPO_ROOT, script_env

MAX_TOKENS = 12
MODEL = "tiny-qwen3-omni"
THINKER_PIPELINE = os.path.join(REPO_ROOT, "deploy", "pipelines", "qwen3_omni_thinker.yaml")


def _png(seed: int, size=(96, 64)) -> bytes:
    return random_png(seed, size)


def _tone(freq: float, seconds: float = 1.5) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000.0
    return (np.sin(2 * np.pi * freq * t) * 0.3 * 32767).astype("<i2")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("models") / MODEL
    build_tiny_qwen3_omni(path, seed=0)
    return str(path)


@pytest.fixture(scope="module")
def hf(tiny):
    """transformers' greedy thinker on chat messages with an optional image and audio clip."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    return thinker_reference(tiny, Qwen3OmniMoeThinkerForConditionalGeneration, _get_feat_extract_output_lengths,
                             MAX_TOKENS)


def test_builder_writes_a_loadable_qwen3_omni_of_its_own_kind(tiny):
    from transformers import Qwen3OmniMoeConfig

    config = Qwen3OmniMoeConfig.from_pretrained(tiny)
    assert config.model_type == "qwen3_omni_moe" and config.enable_audio_output
    assert config.thinker_config.text_config.num_experts > 1
    assert model_kind(tiny) == "qwen3-omni"
    assert bundled_pipeline("qwen3-omni").endswith(".yaml")


def test_compact_thinker_greedy_equals_transformers(tiny, hf):
    """The compact MoE thinker (q/k norm, experts, interleaved M-RoPE) without a server."""
    from omnirelay.workers.llm.models.llama import LlamaModel

    model = LlamaModel(tiny)
    assert model.config.moe is not None and model.config.qk_norm and model.config.mrope_interleaved
    for question in ("Tell me about the harbor town.", "What do the fishing boats bring back?"):
        content = [{"type": "text", "text": question}]
        expected = hf(content)
        assert len(set(expected)) > 3, "the reference itself is degenerate"
        text = hf.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                tokenize=False)
        ids, out = hf.tokenizer(text)["input_ids"], []
        for _ in range(MAX_TOKENS):
            logits, _ = model.prefill(ids + out)
            out.append(int(logits.argmax()))
            if out[-1] in model.config.eos_token_ids:
                break
        assert out == expected


def test_chunked_prefill_cuts_through_the_image_and_keeps_deepstack_in_place(tiny, hf, tmp_path):
    """No network: encode → prefill in chunks of 8 (cutting through the image and the audio, next to a
    text prompt in the same steps, so DeepStack rows are placed per chunk) → decode == transformers."""
    from omnirelay.connectors import create_connector
    from omnirelay.gateway.media import MediaLimits, MediaProcessor
    from omnirelay.workers.encode.qwen3 import Qwen3OmniEncoders
    from omnirelay.request_params import TextParams

    png, pcm = _png(5), _tone(660.0, 0.5)
    media_content = [{"type": "text", "text": "See"}, image_part(png), audio_part(wav_bytes(pcm)),
                     {"type": "text", "text": "and tell."}]
    text = "Tell me a story about the river."
    tok = hf.tokenizer
    media = MediaProcessor(tiny, MediaLimits())
    messages, items = media.extract([{"role": "user", "content": media_content}])
    ids = media.expand(tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)["input_ids"], items)
    text_ids = tok(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"]
    connector = create_connector("shared_memory", {"shm_dir": str(tmp_path)})
    try:
        greedy = TextParams(max_tokens=MAX_TOKENS, temperature=0.0)
        _, model, done = encode_then_prefill(tiny, Qwen3OmniEncoders(tiny), connector, items, ids, text_ids, greedy)
        outputs, _ = decode_prefilled(model, connector, done, {"t": text_ids, "m": ids}, greedy, num_blocks=64)
        assert outputs["m"] == hf(media_content, png=png, pcm=pcm)
        assert outputs["t"] == hf([{"type": "text", "text": text}])
    finally:
        connector.close()


@pytest.fixture(scope="module")
def thinker_server(tiny, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("serve-qwen3-omni") / "omni-serve.log")
    serve = ServeProcess(tiny, "--served-model-name", MODEL, "--stage-configs-path", THINKER_PIPELINE,
                         "--log-level", "WARNING", log_path=log_path)
    yield serve
    serve.stop()


@pytest.fixture(scope="module")
def thinker_client(thinker_server):
    return openai.OpenAI(base_url=thinker_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, content, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True},
                                          **kwargs)


@pytest.mark.slow
def test_image_in_text_out_equals_transformers(thinker_client, hf):
    """Image tokens, DeepStack and interleaved M-RoPE through encode → prefill → decode."""
    png = _png(0)
    content = [{"type": "text", "text": "Look:"}, image_part(png), {"type": "text", "text": "what is it?"}]
    reply = _chat(thinker_client, content)
    expected = hf(content, png=png)
    assert len(set(expected)) > 3, "the reference itself is degenerate"
    assert reply.choices[0].token_ids == expected
    other = _chat(thinker_client, [content[0], image_part(_png(1)), content[2]])
    assert other.choices[0].token_ids == hf(content, png=_png(1))
    assert other.choices[0].token_ids != expected   # the answer depends on the picture


@pytest.mark.slow
def test_audio_and_text_in_text_out_equal_transformers(thinker_client, hf):
    pcm = _tone(440.0)
    content = [audio_part(wav_bytes(pcm)), {"type": "text", "text": "Listen."}]
    assert _chat(thinker_client, content).choices[0].token_ids == hf(content, pcm=pcm)
    both = [{"type": "text", "text": "Look:"}, image_part(_png(2)), audio_part(wav_bytes(pcm)),
            {"type": "text", "text": "and hear?"}]
    assert _chat(thinker_client, both).choices[0].token_ids == hf(both, png=_png(2), pcm=pcm)
    text = [{"type": "text", "text": "What is the weather like today?"}]
    assert _chat(thinker_client, text).choices[0].token_ids == hf(text)


# ------------------------------------------------------------------------------------ speech out

SEED, MAX_CODES = 11, 16
SAMPLE_RATE = 24000


def _reference_speech(model, tokenizer, content: list, png: bytes | None = None) -> tuple[list[int], torch.Tensor]:
    """transformers' Qwen3-Omni generate (:func:`_reference_speech_here`), run in a fresh interpreter on
    ``model``'s directory. In the long slow-tier process the talker's sampling in transformers' own
    generate came out NaN after earlier modules had run (the same call passes in a process of its own
    and with this module alone); the reference must not depend on what ran before it."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = pathlib.Path(tmp) / "spec.json", pathlib.Path(tmp) / "out.npz"
        spec.write_text(json.dumps({"path": model.name_or_path, "content": content,
                                    "png": base64.b64encode(png).decode() if png is not None else None}))
        done = subprocess.run([sys.executable, __file__, str(spec), str(out)], capture_output=True, text=True,
                              timeout=600, cwd=os.path.dirname(__file__), env=script_env())
        assert done.returncode == 0, done.stderr[-4000:]
        with np.load(out, allow_pickle=False) as result:
            return result["reply"].tolist(), torch.from_numpy(result["wav"])


def _reference_speech_here(model, tokenizer, content: list, png: bytes | None = None) -> tuple[list[int], torch.Tensor]:
    """transformers' Qwen3-Omni generate as documented: greedy thinker, the talker's default sampling, seeded."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    media = {}
    if png is not None:
        images = Qwen2VLImageProcessorPil.from_pretrained(model.name_or_path)
        image = images(images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt")
        n = int(image["image_grid_thw"][0].prod()) // images.merge_size ** 2
        text = text.replace(tokenizer.image_token, tokenizer.image_token * n)
        media = {"pixel_values": image["pixel_values"], "image_grid_thw": image["image_grid_thw"]}
    ids = tokenizer(text, return_tensors="pt")
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        sequences, wav = model.generate(**ids, **media, speaker="Ethan", thinker_max_new_tokens=MAX_TOKENS,
                                        thinker_eos_token_id=eos, talker_max_new_tokens=MAX_CODES)
    return sequences[0, ids["input_ids"].shape[1]:].tolist(), wav.reshape(-1).float()


@pytest.fixture(scope="module")
def full_model(tiny):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    torch.set_num_threads(1)
    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny, dtype=torch.float32).eval()


def _int16(wav: torch.Tensor) -> np.ndarray:
    return (wav.clamp(-1, 1) * 32767).round().to(torch.int16).numpy()


def _wav_samples(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SAMPLE_RATE)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


def test_speech_engine_matches_transformers_talker_and_code2wav(tiny, hf, full_model):
    """Talker prompt, code predictor and code2wav, seeded: the waveform of transformers' generate."""
    import time

    from omnirelay.speech_params import SpeechParams
    from omnirelay.workers.speech.engine import SpeechTask
    from omnirelay.workers.speech.qwen3 import load_qwen3_omni

    content = [{"type": "text", "text": "Tell me about the harbor town."}]
    reply, expected = _reference_speech(full_model, hf.tokenizer, content)
    text = hf.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)
    ids = hf.tokenizer(text)["input_ids"]
    engine = load_qwen3_omni(tiny)
    try:
        assert engine.voices == ["Chelsie", "Ethan"]
        hidden = torch.zeros(len(ids), 256)
        task = SpeechTask("r", ids, hidden, reply, torch.zeros(len(reply) - 1, 256),
                          SpeechParams(voice="Ethan", seed=SEED, max_codes=MAX_CODES), deadline=time.time() + 300)
        wav, codes = engine.synthesize(task)
        assert codes > 0 and torch.equal(wav, expected)
        assert wav.pow(2).mean().sqrt() > 0.01   # not silence
        other, _ = engine.synthesize(dataclasses.replace(task, params=SpeechParams(voice="Chelsie", seed=SEED,
                                                                                   max_codes=MAX_CODES)))
        assert not torch.equal(other, wav)      # the voice is the speaker's codec id: it changes the speech
    finally:
        engine.close()


@pytest.fixture(scope="module")
def speech_server(tiny, tmp_path_factory):
    """``omni-serve DIR`` alone: the kind picks deploy/pipelines/qwen3_omni.yaml (all four roles)."""
    log_path = str(tmp_path_factory.mktemp("serve-qwen3-omni-speech") / "omni-serve.log")
    serve = ServeProcess(tiny, "--served-model-name", MODEL, "--log-level", "WARNING", log_path=log_path)
    yield serve
    serve.stop()


@pytest.fixture(scope="module")
def speech_client(speech_server):
    return openai.OpenAI(base_url=speech_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.slow
def test_chat_with_an_image_in_and_audio_out_matches_transformers(speech_client, hf, full_model):
    """encode → prefill → decode → generate: the talker reads the thinker's layer states at the
    image tokens (prefill's capture) and follows the image's M-RoPE grid, as in transformers."""
    png = _png(3)
    content = [{"type": "text", "text": "Look:"}, image_part(png), {"type": "text", "text": "say something."}]
    reply, expected = _reference_speech(full_model, hf.tokenizer, content, png=png)
    response = speech_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "wav"}, max_tokens=MAX_TOKENS, temperature=0, seed=SEED,
        extra_body={"max_audio_tokens": MAX_CODES})
    audio = response.choices[0].message.audio
    assert audio.transcript == hf.tokenizer.decode(reply, skip_special_tokens=True)
    samples = _wav_samples(base64.b64decode(audio.data))
    assert np.sqrt(np.mean((samples / 32767.0) ** 2)) > 0.01          # not silent
    assert samples.shape == _int16(expected).shape
    assert np.abs(samples.astype(np.int32) - _int16(expected).astype(np.int32)).max() <= 1


@pytest.mark.slow
def test_chat_text_in_audio_out_and_the_speech_endpoint(speech_client, hf, full_model):
    content = [{"type": "text", "text": "Tell me about the harbor town."}]
    reply, expected = _reference_speech(full_model, hf.tokenizer, content)
    response = speech_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "wav"}, max_tokens=MAX_TOKENS, temperature=0, seed=SEED,
        extra_body={"max_audio_tokens": MAX_CODES})
    samples = _wav_samples(base64.b64decode(response.choices[0].message.audio.data))
    assert np.abs(samples.astype(np.int32) - _int16(expected).astype(np.int32)).max() <= 1
    # Streamed: code2wav per chunk of codes as the talker speaks (workers/speech/qwen3.py's
    # StreamedCode2Wav), the same speech to within rounding, and as long.
    stream = speech_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "pcm16"}, max_tokens=MAX_TOKENS, temperature=0, seed=SEED,
        extra_body={"max_audio_tokens": MAX_CODES}, stream=True)
    pieces = [event.choices[0].delta.audio for event in stream if event.choices]
    data = b"".join(base64.b64decode(piece.data) for piece in pieces if piece is not None and piece.data)
    streamed = np.frombuffer(data, dtype="<i2")
    assert sum(1 for piece in pieces if piece is not None and piece.data) > 1 and streamed.shape == samples.shape
    assert np.abs(streamed.astype(np.int32) - samples.astype(np.int32)).max() <= 1
    kwargs = dict(model=MODEL, voice="Chelsie", input="Hello there, world.",
                  extra_body={"seed": 7, "max_audio_tokens": 12})
    wav = _wav_samples(speech_client.audio.speech.create(response_format="wav", **kwargs).content)
    assert len(wav) > SAMPLE_RATE // 10 and np.sqrt(np.mean((wav / 32767.0) ** 2)) > 0.01
    pcm = speech_client.audio.speech.create(response_format="pcm", **kwargs)
    assert np.array_equal(np.frombuffer(pcm.content, dtype="<i2"), wav)   # same seed: the same speech
    with pytest.raises(openai.BadRequestError):
        speech_client.audio.speech.create(model=MODEL, voice="Nobody", input="Hi.", response_format="wav")


if __name__ == "__main__":   # the child of _reference_speech: spec.json in, out.npz with reply ids and waveform
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    torch.set_num_threads(1)
    _spec = json.loads(pathlib.Path(sys.argv[1]).read_text())
    _model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(_spec["path"], dtype=torch.float32).eval()
    _reply, _waveform = _reference_speech_here(_model, AutoTokenizer.from_pretrained(_spec["path"]), _spec["content"],
                                               base64.b64decode(_spec["png"]) if _spec["png"] else None)
    np.savez(sys.argv[2], reply=np.array(_reply, dtype=np.int64), wav=_waveform.numpy())
