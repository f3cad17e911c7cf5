"""Qwen3-TTS's talker stepped by us (workers/speech/qwen3_tts_talker.py): the same frames as the
``qwen_tts`` package's own ``generate`` for the same seed (with its KV caches reaching its models:
:func:`_cache_reaches_the_model`), and several requests held at once step
as one batch, each spoken as it is alone. The tiny random model ``omni-make-model tiny-qwen3-tts``
writes; skipped where the package is not installed."""

from __future__ import annotations

import dataclasses
import importlib.util
import time

import pytest
import torch

from omnirelay.speech_params import SpeechParams
from omnirelay.workers.speech.qwen3_tts_package import PACKAGE_HINT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("qwen_tts") is None,
                                reason=f"the qwen_tts package is not installed: {PACKAGE_HINT}")

FRAMES = 20
HELD = 4
TEXTS = ("Hello there, world.", "A longer sentence about the harbor town at dusk.", "Yes.", "Numbers: one, two.")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from omnirelay.deploy.builders.qwen3_tts import build_tiny_qwen3_tts
    from omnirelay.workers.speech.qwen3_tts import load_qwen3_tts
    torch.set_num_threads(1)
    path = build_tiny_qwen3_tts(tmp_path_factory.mktemp("models") / "tiny-qwen3-tts", seed=0)
    engine = load_qwen3_tts(str(path), max_batch_size=HELD)
    from transformers import AutoTokenizer
    engine.tokenizer = AutoTokenizer.from_pretrained(str(path))
    yield engine
    engine.close()


def _task(engine, request_id: str, text: str, seed: int = 3):
    from omnirelay.workers.speech.qwen3_tts import TTSTask
    ids = engine.family.wrap(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    return TTSTask(request_id, ids, SpeechParams(engine.voices[0], seed=seed, max_codes=FRAMES), time.time() + 300)


def _cache_reaches_the_model(module, args, kwargs):
    """transformers 5.25's generate() hands the KV cache over as ``cache``; the package's talker and
    code predictor take ``past_key_values``, so without this rename every step of theirs runs
    without its history (a fresh cache per forward: what serving through the package's generate
    did before our own step loop)."""
    if "cache" in kwargs:
        kwargs["past_key_values"] = kwargs.pop("cache")
    return args, kwargs


def test_the_frames_are_the_package_generates(engine):
    task = _task(engine, "r", TEXTS[1])
    talker = engine.family.model.talker
    hooks = [m.register_forward_pre_hook(_cache_reaches_the_model, with_kwargs=True)
             for m in (talker, talker.code_predictor)]
    try:
        torch.manual_seed(task.params.seed)
        with torch.inference_mode():
            expected, _ = engine.family.model.generate(
                input_ids=[torch.tensor([task.prompt_token_ids])], languages=["auto"], speakers=[task.params.voice],
                non_streaming_mode=True, max_new_tokens=FRAMES, **engine.family.sampling)
    finally:
        for hook in hooks:
            hook.remove()
    wav, frames = engine.synthesize(task)
    assert frames == expected[0].shape[0] > 0
    torch.testing.assert_close(wav, engine.family.decode(expected[0]), rtol=0, atol=0)


def test_requests_held_together_step_as_one_batch_and_are_each_spoken_as_alone(engine):
    tasks = [_task(engine, f"r{i}", text) for i, text in enumerate(TEXTS)]
    alone = {t.request_id: engine.synthesize(t) for t in tasks}
    engine.step_batch.largest = 0
    for task in tasks:
        engine.add(dataclasses.replace(task))
    outputs, failed = {}, []
    for _ in range(20_000):   # bounded: four short answers take a few seconds of steps
        if not engine.has_work:
            break
        out = engine.step()
        outputs.update({o.request_id: o for o in out.outputs})
        failed += out.failed
    assert not failed and sorted(outputs) == sorted(alone)
    assert engine.step_batch.largest == HELD
    for request_id, (wav, frames) in alone.items():
        assert outputs[request_id].num_codes == frames
        torch.testing.assert_close(outputs[request_id].waveform, wav, rtol=0, atol=0)


def test_a_one_shot_request_cancelled_while_it_runs_stops_at_its_next_frame(engine):
    task = _task(engine, "long", TEXTS[1])
    task = dataclasses.replace(task, params=SpeechParams(engine.voices[0], seed=3, max_codes=4000))
    batches = engine.step_batch.batches
    engine.add(task)
    for _ in range(20_000):   # bounded: until its talker has taken a few steps
        engine.step(wait_s=0.001)
        if engine.step_batch.batches - batches >= 3:
            break
    assert engine.cancel("long")
    at_cancel = engine.step_batch.batches
    for _ in range(20_000):
        if not engine.has_work:
            break
        out = engine.step()
        assert not out.outputs and not out.failed   # a cancelled request answers nothing
    assert not engine.has_work
    assert engine.step_batch.batches - at_cancel <= 2   # the step under way, at most one more
