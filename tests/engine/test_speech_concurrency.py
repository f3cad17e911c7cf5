"""Several requests in one Qwen2.5-Omni speech engine at once: each is spoken exactly as it is alone.

The synthesis threads share one talker module and take turns step by step (workers/speech/turns.py),
so a request's talker steps interleave with the others'. What each step reads — its own reply's next
row — must come from the thread that runs the forward. (Before, every request hooked the shared
talker, so with two requests held each forward ran both hooks: a talker read the other request's
reply and advanced its step count, and at eight streamed answers on a 2-core host a talker waited
30 s for a chunk of another request's stream, then the answer was resubmitted.)
"""

from __future__ import annotations

import time

import pytest
import torch

from omnirelay.deploy.builders.omni import build_tiny_omni
from omnirelay.speech_params import SpeechParams
from omnirelay.workers.speech.engine import GenerateSpeechEngine, SpeechTask

CODES = 12


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    torch.set_num_threads(1)
    path = build_tiny_omni(tmp_path_factory.mktemp("models") / "tiny-omni", seed=0)
    engine = GenerateSpeechEngine.from_pretrained(str(path), max_batch_size=3)
    yield engine
    engine.close()


def _task(engine: GenerateSpeechEngine, request_id: str, seed: int) -> SpeechTask:
    """A request with its own random prompt states and its own six-token reply."""
    hidden = engine.thinker_embed.shape[1]
    gen = torch.Generator().manual_seed(seed)
    prompt = [int(t) for t in torch.randint(100, 1000, (10,), generator=gen)]
    reply = [int(t) for t in torch.randint(100, 1000, (6,), generator=gen)]
    return SpeechTask(request_id, prompt, torch.randn(len(prompt), hidden, generator=gen), reply,
                      torch.randn(len(reply) - 1, hidden, generator=gen),
                      SpeechParams("Chelsie", seed=7, max_codes=CODES), time.time() + 300)


def test_requests_held_together_are_each_spoken_as_alone(engine):
    tasks = [_task(engine, f"r{i}", seed=i) for i in range(3)]
    alone = {t.request_id: engine.synthesize(t)[0] for t in tasks}
    # The same seed for all three: only the replies differ, and they must be heard.
    assert not torch.equal(alone["r0"], alone["r1"]) and not torch.equal(alone["r1"], alone["r2"])

    for task in tasks:
        engine.add(task)
    outputs, failed, held_at_once = {}, [], 0
    for _ in range(20_000):   # bounded: three 12-code answers take a few seconds of steps
        if not engine.has_work:
            break
        out = engine.step()
        held_at_once = max(held_at_once, len(engine.running))
        outputs.update({o.request_id: o for o in out.outputs})
        failed += out.failed
    assert not failed and sorted(outputs) == ["r0", "r1", "r2"]
    assert held_at_once == 3   # their talker steps interleaved
    for request_id, wav in alone.items():
        assert outputs[request_id].num_codes == CODES
        torch.testing.assert_close(outputs[request_id].waveform, wav, rtol=0, atol=0)
