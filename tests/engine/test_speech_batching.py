"""Several requests in one speech engine at once: their talker steps run as one batched forward
(workers/speech/step_batch.py), and each request is still spoken exactly as it is alone.

Both omni families: Qwen2.5-Omni (talker + token2wav) and Qwen3-Omni (talker + code predictor +
code2wav). A request samples from its own generator, so a batch cannot move its draws; on this
CPU build a row's logits in a batch are bitwise those alone too, which is what makes the audio
bitwise equal here (the engine's determinism contract, engine.py).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from omnirelay.deploy.builders.omni import build_tiny_omni
from omnirelay.deploy.builders.qwen3_omni import build_tiny_qwen3_omni
from omnirelay.speech_params import SpeechParams
from omnirelay.workers.speech.engine import GenerateSpeechEngine, SpeechTask
from omnirelay.workers.speech.qwen2_5_omni import load_qwen2_5_omni
from omnirelay.workers.speech.qwen3 import Qwen3OmniFamily, load_qwen3_omni

CODES = 24
HELD = 4


def _engine(tmp_path_factory, folder: str, build, load):
    torch.set_num_threads(1)
    path = build(tmp_path_factory.mktemp("models") / folder, seed=0)
    return load(str(path), max_batch_size=HELD)


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    engine = _engine(tmp_path_factory, "tiny-omni", build_tiny_omni, load_qwen2_5_omni)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    engine = _engine(tmp_path_factory, "tiny-qwen3-omni", build_tiny_qwen3_omni, load_qwen3_omni)
    yield engine
    engine.close()


def _task(engine: GenerateSpeechEngine, request_id: str, seed: int, prompt_len: int = 10) -> SpeechTask:
    """A request with its own random prompt states and its own six-token reply (the same talker seed
    for all: only the replies differ, and they must be heard)."""
    hidden = engine.family.thinker_embed.shape[1]
    gen = torch.Generator().manual_seed(seed)
    prompt = [int(t) for t in torch.randint(100, 1000, (prompt_len,), generator=gen)]
    if isinstance(engine.family, Qwen3OmniFamily):   # its talker speaks the prompt's assistant turn
        cfg = engine.family.config
        prompt = [cfg.im_start_token_id, cfg.user_token_id, *prompt, cfg.im_start_token_id, cfg.assistant_token_id]
    reply = [int(t) for t in torch.randint(100, 1000, (6,), generator=gen)]
    voice = engine.voices[0]
    return SpeechTask(request_id, prompt, torch.randn(len(prompt), hidden, generator=gen), reply,
                      torch.randn(len(reply) - 1, hidden, generator=gen),
                      SpeechParams(voice, seed=7, max_codes=CODES), time.time() + 300)


def _held_together(engine: GenerateSpeechEngine, tasks: list[SpeechTask]) -> dict:
    for task in tasks:
        engine.add(task)
    outputs, failed = {}, []
    for _ in range(20_000):   # bounded: a few short answers take seconds of steps
        if not engine.has_work:
            break
        out = engine.step()
        outputs.update({o.request_id: o for o in out.outputs})
        failed += out.failed
    assert not failed and sorted(outputs) == sorted(t.request_id for t in tasks)
    return outputs


@pytest.mark.parametrize("family", ["omni", "qwen3"])
def test_requests_held_together_step_as_one_batch_and_are_each_spoken_as_alone(family, request):
    engine = request.getfixturevalue(family)
    # Prompts of different lengths: the batch cache pads them side by side.
    tasks = [_task(engine, f"r{i}", seed=i, prompt_len=8 + 3 * i) for i in range(HELD)]
    alone = {t.request_id: engine.synthesize(t) for t in tasks}
    assert len({tuple(wav.tolist()) for wav, _ in alone.values()}) == HELD

    batches, rows = engine.step_batch.batches, engine.step_batch.rows
    outputs = _held_together(engine, [dataclasses.replace(t) for t in tasks])
    stepped, carried = engine.step_batch.batches - batches, engine.step_batch.rows - rows
    assert engine.step_batch.largest == HELD
    assert carried / stepped > HELD / 2   # most steps carried most requests
    for request_id, (wav, codes) in alone.items():
        assert outputs[request_id].num_codes == codes
        torch.testing.assert_close(outputs[request_id].waveform, wav, rtol=0, atol=0)


def test_a_request_that_joins_a_running_batch_is_spoken_as_alone(omni):
    """A request added while another is mid-answer: the newcomers' caches join the batch's."""
    tasks = [_task(omni, f"j{i}", seed=10 + i, prompt_len=5 + 7 * i) for i in range(3)]
    alone = {t.request_id: omni.synthesize(t)[0] for t in tasks}
    batches, omni.step_batch.largest = omni.step_batch.batches, 0
    omni.add(dataclasses.replace(tasks[0]))
    outputs = {}
    for _ in range(20_000):   # bounded: until the first request has taken a few steps alone
        outputs.update({o.request_id: o for o in omni.step(wait_s=0.001).outputs})
        if omni.step_batch.batches - batches >= 3:
            break
    assert not outputs   # still speaking
    for task in tasks[1:]:
        omni.add(dataclasses.replace(task))
    for _ in range(20_000):
        if not omni.has_work:
            break
        out = omni.step()
        assert not out.failed
        outputs.update({o.request_id: o for o in out.outputs})
    assert omni.step_batch.largest == 3   # the three rode together
    for request_id, wav in alone.items():
        torch.testing.assert_close(outputs[request_id].waveform, wav, rtol=0, atol=0)
