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
import io
import os
import wave

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from omnirelay.deploy.qwen3_omni_builder import build_tiny_qwen3_omni
from omnirelay.deploy.served_models import bundled_pipeline, model_kind

from conftest import ServeProcess

MAX_TOKENS = 12
MODEL = "tiny-qwen3-omni"
THINKER_PIPELINE = os.path.join(os.path.dirname(__file__), "..", "deploy", "pipelines", "qwen3_omni_thinker.yaml")


def _png(seed: int, size=(96, 64)) -> bytes:
    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def _tone(freq: float, seconds: float = 1.5) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000.0
    return (np.sin(2 * np.pi * freq * t) * 0.3 * 32767).astype("<i2")


def _wav(pcm: np.ndarray, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as handle:
        handle.setnchannels(1)
        handle.setsampwidth(2)
        handle.setframerate(rate)
        handle.writeframes(pcm.tobytes())
    return out.getvalue()


def _image_part(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


def _audio_part(wav: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("models") / MODEL
    build_tiny_qwen3_omni(path, seed=0)
    return str(path)


@pytest.fixture(scope="module")
def hf(tiny):
    """transformers' greedy thinker on chat messages with an optional image and audio clip."""
    from transformers import AutoTokenizer, Qwen3OmniMoeThinkerForConditionalGeneration, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    thinker = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(tiny, dtype=torch.float32).eval()
    images, features = Qwen2VLImageProcessorPil.from_pretrained(tiny), WhisperFeatureExtractor.from_pretrained(tiny)

    def generate(content: list, png: bytes | None = None, pcm: np.ndarray | None = None) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        kwargs = {}
        if png is not None:
            image = images(images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt")
            n = int(image["image_grid_thw"][0].prod()) // images.merge_size ** 2
            text = text.replace(tokenizer.image_token, tokenizer.image_token * n)
            kwargs.update(pixel_values=image["pixel_values"], image_grid_thw=image["image_grid_thw"])
        if pcm is not None:
            audio = features([pcm.astype(np.float32) / 32768.0], sampling_rate=16000, return_attention_mask=True,
                             padding="max_length", return_tensors="pt")
            n = int(_get_feat_extract_output_lengths(audio["attention_mask"].sum(-1))[0])
            text = text.replace(tokenizer.audio_token, tokenizer.audio_token * n)
            kwargs.update(input_features=audio["input_features"], feature_attention_mask=audio["attention_mask"])
        ids = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            out = thinker.generate(**ids, **kwargs, max_new_tokens=MAX_TOKENS, do_sample=False)
        return out[0, ids["input_ids"].shape[1]:].tolist()

    generate.tokenizer = tokenizer
    return generate


def test_builder_writes_a_loadable_qwen3_omni_of_its_own_kind(tiny):
    from transformers import Qwen3OmniMoeConfig

    config = Qwen3OmniMoeConfig.from_pretrained(tiny)
    assert config.model_type == "qwen3_omni_moe" and config.enable_audio_output
    assert config.thinker_config.text_config.num_experts > 1
    assert model_kind(tiny) == "qwen3-omni"
    assert bundled_pipeline("qwen3-omni").endswith(".yaml")


def test_compact_thinker_greedy_equals_transformers(tiny, hf):
    """The compact MoE thinker (q/k norm, experts, interleaved M-RoPE) without a server."""
    from omnirelay.workers.models.llama import LlamaModel

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
    content = [{"type": "text", "text": "Look:"}, _image_part(png), {"type": "text", "text": "what is it?"}]
    reply = _chat(thinker_client, content)
    expected = hf(content, png=png)
    assert len(set(expected)) > 3, "the reference itself is degenerate"
    assert reply.choices[0].token_ids == expected
    other = _chat(thinker_client, [content[0], _image_part(_png(1)), content[2]])
    assert other.choices[0].token_ids == hf(content, png=_png(1))
    assert other.choices[0].token_ids != expected   # the answer depends on the picture


@pytest.mark.slow
def test_audio_and_text_in_text_out_equal_transformers(thinker_client, hf):
    pcm = _tone(440.0)
    content = [_audio_part(_wav(pcm)), {"type": "text", "text": "Listen."}]
    assert _chat(thinker_client, content).choices[0].token_ids == hf(content, pcm=pcm)
    both = [{"type": "text", "text": "Look:"}, _image_part(_png(2)), _audio_part(_wav(pcm)),
            {"type": "text", "text": "and hear?"}]
    assert _chat(thinker_client, both).choices[0].token_ids == hf(both, png=_png(2), pcm=pcm)
    text = [{"type": "text", "text": "What is the weather like today?"}]
    assert _chat(thinker_client, text).choices[0].token_ids == hf(text)
