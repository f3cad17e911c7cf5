"""Defects of the speech engine's threads (issue #42), on the real engine of the tiny Qwen2.5-Omni:

* a one-shot request's token2wav held the engine's one turn for the whole utterance (its noise came
  from the global random stream, swapped in under that turn), so every new request's talker start
  waited behind it: now the noise comes from the request's own generator and token2wav takes only
  a vocoder slot;
* a request cancelled while it ran, whose thread then failed by running out of memory, was still
  reported as failed (to a broker that had already forgotten it, or over its next attempt).

The test holds a one-shot request inside its vocoder (BigVGAN) with a forward pre-hook on that
module (the only way to hold a thread at a known point, and to raise the CUDA out-of-memory error a
CPU cannot); everything else is the engine as the worker runs it. Every wait is bounded.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from omnirelay.deploy.builders.omni import build_tiny_omni
from omnirelay.speech_params import SpeechParams
from omnirelay.workers.speech.engine import GenerateSpeechEngine, SpeechTask
from omnirelay.workers.speech.qwen2_5_omni import load_qwen2_5_omni

BOUND_S = 60.0   # "hung": far beyond what these few codes take


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    torch.set_num_threads(1)
    path = build_tiny_omni(tmp_path_factory.mktemp("models") / "tiny-omni", seed=0)
    engine = load_qwen2_5_omni(str(path), max_batch_size=2)
    yield engine
    engine.close()


def _task(engine: GenerateSpeechEngine, request_id: str, *, stream: bool = False) -> SpeechTask:
    hidden = engine.family.thinker_embed.shape[1]
    gen = torch.Generator().manual_seed(7)
    prompt = [int(t) for t in torch.randint(100, 1000, (10,), generator=gen)]
    reply = [int(t) for t in torch.randint(100, 1000, (6,), generator=gen)]
    return SpeechTask(request_id, prompt, torch.randn(len(prompt), hidden, generator=gen), reply,
                      torch.randn(len(reply) - 1, hidden, generator=gen),
                      SpeechParams("Chelsie", seed=1, max_codes=24), time.time() + 600, stream=stream)


class HeldVocoder:
    """Holds the first thread that enters the vocoder until :meth:`let_go`; ``fail`` is raised there."""

    def __init__(self, engine: GenerateSpeechEngine, fail: BaseException | None = None):
        self.entered, self.go, self.fail = threading.Event(), threading.Event(), fail
        self._taken = False
        self._lock = threading.Lock()
        self.handle = engine.family.token2wav.code2wav_bigvgan_model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        with self._lock:
            first, self._taken = not self._taken, True
        if not first:
            return None
        self.entered.set()
        self.go.wait(BOUND_S)
        if self.fail is not None:
            raise self.fail
        return None

    def let_go(self) -> None:
        self.go.set()

    def remove(self) -> None:
        self.go.set()
        self.handle.remove()


def _step_until(engine: GenerateSpeechEngine, done, out: dict) -> None:
    deadline = time.monotonic() + BOUND_S
    while not done():
        assert time.monotonic() < deadline, f"bound passed: {out}"
        step = engine.step()
        out.setdefault("outputs", []).extend(step.outputs)
        out.setdefault("chunks", []).extend(step.chunks)
        out.setdefault("failed", []).extend(step.failed)


def test_a_one_shot_token2wav_does_not_hold_back_a_new_requests_talker(engine):
    held = HeldVocoder(engine)
    out: dict = {}
    try:
        engine.add(_task(engine, "one-shot"))
        _step_until(engine, held.entered.is_set, out)   # its token2wav runs (and stays)
        engine.add(_task(engine, "streamed", stream=True))
        # The streamed request starts its talker and speaks to its end while the one-shot's
        # vocoder is still held: nothing of the one-shot's stands in its way.
        _step_until(engine, lambda: any(c.request_id == "streamed" and c.final for c in out.get("chunks", [])), out)
        assert not held.go.is_set() and not out["outputs"] and not out["failed"]
        held.let_go()
        _step_until(engine, lambda: not engine.has_work, out)
        assert [o.request_id for o in out["outputs"]] == ["one-shot"] and not out["failed"]
    finally:
        held.remove()


def test_a_request_cancelled_then_out_of_memory_is_not_reported(engine):
    held = HeldVocoder(engine, fail=torch.cuda.OutOfMemoryError("CUDA out of memory (raised by the test)"))
    out: dict = {}
    try:
        engine.add(_task(engine, "cancelled"))
        _step_until(engine, held.entered.is_set, out)
        assert engine.cancel("cancelled")
        held.let_go()   # its thread now ends in the out-of-memory error
        _step_until(engine, lambda: not engine.has_work, out)
        assert not out["failed"] and not out["outputs"]
        assert "cancelled" not in engine.requests and not engine.draining
    finally:
        held.remove()
