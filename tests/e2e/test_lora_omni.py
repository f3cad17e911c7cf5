"""LoRA on the omni thinkers (issue #29): Qwen2.5-Omni and Qwen3-Omni, text and spoken answers.

A real ``omni-serve`` with ``--enable-lora`` on the tiny random omni models, driven through the
official ``openai`` client. The adapters are written by ``omni-make-model tiny-lora`` for the
thinker (peft on transformers' thinker class, the language model's layers only); the reference is
that thinker with the adapter applied by peft, unmerged (``PeftModel.from_pretrained``), greedy:

* Qwen2.5-Omni (``deploy/pipelines/omni.yaml``: encode → prefill → decode → generate): the base and
  two adapters, on a text prompt and on an audio + text prompt, equal the reference token for
  token; a spoken answer under an adapter has the reference's transcript and, within 1 LSB, the
  audio transformers' whole Qwen2.5-Omni speaks with the peft-wrapped thinker (same seed).
* Qwen3-Omni (``qwen3_omni_thinker.yaml``, MoE thinker: attention adapters, the experts carry none)
  the same text parity.
"""

from __future__ import annotations

import base64
import os

import numpy as np
import openai
import pytest

from conftest import ServeProcess
from media_support import audio_part, thinker_reference, wav_bytes, wav_samples
from repo_paths import REPO_ROOT

peft = pytest.importorskip("peft")

# Two omni clusters plus transformers' references: minutes on 2 shared cores.
pytestmark = pytest.mark.slow

PIPELINES = os.path.join(REPO_ROOT, "deploy", "pipelines")
MAX_TOKENS = 12
SPOKEN_TOKENS, MAX_CODES, SEED = 8, 16, 1234
TEXT = [{"type": "text", "text": "Tell me about the sea."}]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _tone(freq: float, seconds: float = 0.7) -> np.ndarray:
    pcm = np.round(0.5 * np.sin(np.arange(int(16000 * seconds)) * 2 * np.pi * freq / 16000) * 32767)
    return pcm.astype("<i2")


def _with_adapter(thinker_class: type, adapter: str) -> type:
    """``thinker_class`` as :func:`thinker_reference` loads it, with ``adapter`` applied by peft (unmerged)."""
    class WithAdapter:
        @staticmethod
        def from_pretrained(path, dtype):
            return peft.PeftModel.from_pretrained(thinker_class.from_pretrained(path, dtype=dtype), adapter)

    return WithAdapter


def _lora_args(adapters: dict[str, str]) -> list[str]:
    return ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            *(arg for name, path in adapters.items() for arg in ("--lora-modules", f"{name}={path}"))]


def _chat(client, model: str, content: list, **kwargs) -> list[int]:
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                            max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"return_token_ids": True}, **kwargs)
    assert answer.model == model
    return answer.choices[0].token_ids


# ------------------------------------------------------------------------------------ Qwen2.5-Omni


@pytest.fixture(scope="module")
def omni(tmp_path_factory) -> dict:
    from omnirelay.deploy.builders.lora import build_tiny_lora
    from omnirelay.deploy.builders.omni import build_tiny_omni

    root = tmp_path_factory.mktemp("omni-lora")
    model = str(build_tiny_omni(root / "tiny-omni", seed=0))
    adapters = {"t1": str(build_tiny_lora(model, root / "t1", rank=8, seed=1)),
                "t2": str(build_tiny_lora(model, root / "t2", rank=4, targets=ATTENTION, seed=2))}
    serve = ServeProcess(model, "--served-model-name", "tiny-omni", "--stage-configs-path",
                         os.path.join(PIPELINES, "omni.yaml"), "--log-level", "WARNING", *_lora_args(adapters),
                         log_path=str(root / "omni-serve.log"), timeout=300)
    try:
        yield {"model": model, "adapters": adapters, "serve": serve,
               "client": openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=300)}
    finally:
        serve.stop()


def test_qwen2_5_omni_thinker_text_answers_under_adapters_equal_peft(omni):
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration as Thinker
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths as lengths

    pcm = _tone(660.0)
    with_audio = [audio_part(wav_bytes(pcm)), {"type": "text", "text": "What do you hear?"}]
    answers = {}
    for name, adapter in (("tiny-omni", None), *omni["adapters"].items()):
        hf = thinker_reference(omni["model"], Thinker if adapter is None else _with_adapter(Thinker, adapter),
                               lengths, MAX_TOKENS)
        answers[name] = _chat(omni["client"], name, TEXT)
        assert answers[name] == hf(TEXT), name
        assert _chat(omni["client"], name, with_audio) == hf(with_audio, pcm=pcm), name
    # The adapters change the answer (the parity above compares something real).
    assert len({tuple(tokens) for tokens in answers.values()}) == 3, answers


def test_qwen2_5_omni_spoken_answer_under_an_adapter_equals_peft(omni):
    import torch
    from transformers import AutoTokenizer

    from omnirelay.deploy.builders.omni import load_full_model

    tok = AutoTokenizer.from_pretrained(omni["model"])
    messages = [{"role": "user", "content": "Say hello to the world"}]
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    torch.set_num_threads(1)
    model = load_full_model(omni["model"]).eval()
    model.thinker = peft.PeftModel.from_pretrained(model.thinker, omni["adapters"]["t1"]).eval()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        sequences, wav = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        speaker="Ethan", thinker_max_new_tokens=SPOKEN_TOKENS,
                                        thinker_do_sample=False, talker_max_new_tokens=MAX_CODES)
    reply = sequences[0, len(ids):].tolist()
    answer = omni["client"].chat.completions.create(
        model="t1", messages=messages, modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"},
        max_tokens=SPOKEN_TOKENS, temperature=0, seed=SEED, extra_body={"max_audio_tokens": MAX_CODES})
    audio = answer.choices[0].message.audio
    assert answer.model == "t1" and audio is not None
    assert audio.transcript == tok.decode(reply, skip_special_tokens=True)
    samples = wav_samples(base64.b64decode(audio.data), 24000)
    expected = (wav.float().clamp(-1, 1) * 32767).round().to(torch.int16).numpy()
    assert samples.shape == expected.shape and np.sqrt(np.mean((samples / 32767.0) ** 2)) > 0.01
    assert np.abs(samples.astype(np.int32) - expected.astype(np.int32)).max() <= 1


# ------------------------------------------------------------------------------------ Qwen3-Omni


def test_qwen3_omni_thinker_text_answers_under_an_adapter_equal_peft(tmp_path):
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration as Thinker
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths as lengths

    from omnirelay.deploy.builders.lora import build_tiny_lora
    from omnirelay.deploy.builders.qwen3_omni import build_tiny_qwen3_omni

    model = str(build_tiny_qwen3_omni(tmp_path / "tiny-qwen3-omni", seed=0))
    adapters = {"q1": str(build_tiny_lora(model, tmp_path / "q1", rank=8, targets=ATTENTION, seed=1))}
    pcm = _tone(440.0)
    with_audio = [audio_part(wav_bytes(pcm)), {"type": "text", "text": "What do you hear?"}]
    with ServeProcess(model, "--served-model-name", "tiny-qwen3-omni", "--stage-configs-path",
                      os.path.join(PIPELINES, "qwen3_omni_thinker.yaml"), "--log-level", "WARNING",
                      *_lora_args(adapters), log_path=str(tmp_path / "omni-serve.log"), timeout=300) as serve:
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        base = _chat(client, "tiny-qwen3-omni", TEXT)
        assert base == thinker_reference(model, Thinker, lengths, MAX_TOKENS)(TEXT)
        hf = thinker_reference(model, _with_adapter(Thinker, adapters["q1"]), lengths, MAX_TOKENS)
        tuned = _chat(client, "q1", TEXT)
        assert tuned == hf(TEXT) and tuned != base
        assert _chat(client, "q1", with_audio) == hf(with_audio, pcm=pcm)
