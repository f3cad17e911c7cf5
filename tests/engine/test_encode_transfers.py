"""The encode engine never waits on the store (workers/encode/engine.py, workers/encode/embeds_send.py).

Real encoders (the tiny Qwen2.5-Omni), the real shared-memory connector in a private directory,
read and written through :class:`HeldConnector`, which holds the puts of chosen keys until the test
lets them through: progress is counted in steps and results, never timed.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from omnirelay.deploy.builders.omni import build_tiny_omni
from omnirelay.errors import TransferFailed
from omnirelay.workers.encode.engine import EncodeEngine, EncodeResult, EncodeTask, MediaItem, OmniEncoders
from omnirelay.workers.runtime.engine import RequestFailure

from engine_support import connector, shm_keys  # noqa: F401  (fixtures)
from held_connector import HeldConnector
from media_support import random_png, tiny_model_dir


@pytest.fixture(scope="module")
def encoders(tmp_path_factory) -> OmniEncoders:
    return OmniEncoders(tiny_model_dir(tmp_path_factory, "tiny-omni", build_tiny_omni))


def task(request_id: str, seed: int) -> EncodeTask:
    return EncodeTask(request_id, [MediaItem("image", random_png(seed, (56, 56)))], time.time() + 60)


@contextlib.contextmanager
def engine_on(encoders, held: HeldConnector, tmp_path, **options):
    """An engine over ``held``; on the way out every held put is let through, the engine closed,
    and no key is left (the test deletes the ones it was handed, as prefill would)."""
    engine = EncodeEngine(encoders, held, **options)
    try:
        yield engine
    finally:
        held.let_through()
        engine.close()
    assert shm_keys(tmp_path) == []


def consume(connector, results: dict) -> None:
    for result in results.values():
        connector.delete(result.outputs.mm_key)


def step_until(engine: EncodeEngine, results: dict, done, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        for result in engine.step():
            assert result.request_id not in results, f"{result.request_id} reported twice"
            results[result.request_id] = result
        if done():
            return
    raise AssertionError(f"the engine did not get there (results so far: {sorted(results)})")


def test_on_shared_memory_a_request_is_reported_in_the_step_that_encoded_it(encoders, connector):
    engine = EncodeEngine(encoders, connector)
    try:
        engine.add(task("a", 1))
        (result,) = engine.step()
        assert isinstance(result, EncodeResult) and not engine.has_work
        assert connector.get(result.outputs.mm_key, result.outputs.mm_handle, timeout=1)["image_embeds"].ndim == 2
    finally:
        engine.close()


def test_a_held_put_does_not_stall_the_next_batch(encoders, connector, tmp_path):
    """r0's embeddings' put is held: r1, added after it, is encoded and reported meanwhile; r0 is
    reported once its put returns, with exactly the embeddings of a run where nothing was held."""
    alone = EncodeEngine(encoders, connector)
    alone.add(task("r0", 1))
    (want,) = alone.step()
    want_embeds = connector.get(want.outputs.mm_key, want.outputs.mm_handle, timeout=1)["image_embeds"].clone()
    connector.delete(want.outputs.mm_key)
    alone.close()

    held = HeldConnector(connector)
    held.hold("mm/r0/0")
    with engine_on(encoders, held, tmp_path) as engine:
        engine.add(task("r0", 1))
        results: dict = {}
        assert engine.step() == []
        held.wait_entered("mm/r0/0")
        engine.add(task("r1", 2))
        step_until(engine, results, lambda: "r1" in results)
        assert "r0" not in results and isinstance(results["r1"], EncodeResult)
        held.let_through()
        step_until(engine, results, lambda: not engine.has_work)
        got = results["r0"]
        assert isinstance(got, EncodeResult) and got.outputs.image_grids == want.outputs.image_grids
        assert torch.equal(connector.get(got.outputs.mm_key, got.outputs.mm_handle, timeout=1)["image_embeds"],
                           want_embeds)
        consume(connector, results)


@pytest.mark.parametrize("how", ["cancel", "close"])
def test_a_request_leaving_while_its_put_is_held_leaves_no_key(encoders, connector, tmp_path, how):
    held = HeldConnector(connector)
    held.hold("mm/c/0")
    engine = EncodeEngine(encoders, held)
    try:
        engine.add(task("c", 3))
        assert engine.step() == []
        held.wait_entered("mm/c/0")
        if how == "cancel":
            assert engine.cancel("c")
            assert not engine.cancel("c")   # once
        else:
            engine.close()
    finally:
        held.let_through()
    held.join_threads()
    if how == "cancel":
        results: dict = {}
        step_until(engine, results, lambda: not engine.has_work)
        assert results == {}   # nothing reported for a cancelled request
    engine.close()
    assert shm_keys(tmp_path) == []


def test_no_new_batch_starts_while_the_puts_are_stuck(encoders, connector, tmp_path):
    """MAX_SENDS batches' embeddings on their way and stuck: the next request waits (its memory is
    not added to theirs), then runs once they are out."""
    held = HeldConnector(connector)
    stuck = [f"s{i}" for i in range(EncodeEngine.MAX_SENDS)]
    for rid in stuck:
        held.hold(f"mm/{rid}/0")
    with engine_on(encoders, held, tmp_path, max_batch=1) as engine:
        for i, rid in enumerate(stuck):
            engine.add(task(rid, 10 + i))
            assert engine.step() == []
        engine.add(task("next", 20))
        for _ in range(3):
            assert engine.step() == []
        assert [t.request_id for t in engine.waiting] == ["next"] and engine.num_requests == 1
        held.let_through()
        results: dict = {}
        step_until(engine, results, lambda: not engine.has_work)
        assert sorted(results) == sorted([*stuck, "next"])
        assert all(isinstance(r, EncodeResult) for r in results.values())
        consume(connector, results)


def test_a_failed_put_fails_only_its_request(encoders, connector, tmp_path):
    class FailingPuts(HeldConnector):
        def put(self, key, payload):
            if key == "mm/bad/0":
                raise TransferFailed("store full (on purpose)")
            return super().put(key, payload)

    engine = EncodeEngine(encoders, FailingPuts(connector))
    try:
        engine.add(task("bad", 4))
        engine.add(task("good", 5))
        results: dict = {}
        step_until(engine, results, lambda: not engine.has_work)
        assert isinstance(results["bad"], RequestFailure) and results["bad"].error_type == "transfer_failed"
        assert isinstance(results["good"], EncodeResult)
        connector.delete(results["good"].outputs.mm_key)
    finally:
        engine.close()
    assert shm_keys(tmp_path) == []
