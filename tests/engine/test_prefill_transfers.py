"""Prefill never blocks its batch on a transfer (workers/llm/prefill.py, workers/llm/handoff_jobs.py).

No network: real engines in this process, the real shared-memory connector in a private directory.
The prefill reads and writes through :class:`HeldConnector`, which holds the calls on chosen keys
until the test lets them through, so "while a media get / a KV hand-off is pending" is a state the
test controls: progress is counted in steps and results, never timed.
"""

from __future__ import annotations

import json
import threading
import os
import time

import pytest
import torch

from omnirelay.connectors import create_connector
from omnirelay.deploy.builders.omni import build_tiny_omni
from omnirelay.workers.kv.export import import_kv
from omnirelay.workers.llm.prefill import PrefillEngine, PrefillTask
from omnirelay.request_params import TextParams

from engine_support import (  # noqa: F401
    GREEDY, QUESTIONS, chat_ids, connector, is_first_token, is_result, model, outcomes, runner_for, shm_keys, tok)
from held_connector import HeldConnector
from media_support import image_part, random_png, tiny_model_dir


@pytest.fixture(scope="module")
def tiny_omni(tmp_path_factory) -> str:
    return tiny_model_dir(tmp_path_factory, "tiny-omni", build_tiny_omni)


def step_until(engine: PrefillEngine, results: dict, done, max_steps: int = 400) -> None:
    """Step until ``done()``; each request's outcome goes into ``results``, its early first token
    (sent while its hand-off is on its way) under ``("first", request_id)``."""
    for _ in range(max_steps):
        for result in outcomes(engine.step()):
            key = ("first", result.request_id) if is_first_token(result) else result.request_id
            assert key not in results, f"{key} reported twice"
            results[key] = result
        if done():
            return
    raise AssertionError(f"the engine did not get there (results so far: {sorted(results)})")


def r0_handoff_held(model, tok, connector, **options) -> tuple[HeldConnector, PrefillEngine, dict]:
    """A whole-KV prefill engine (``options`` added) whose r0 is prefilled and held in its KV put,
    and r1 added behind it: the held connector, the engine, the results so far (none)."""
    held = HeldConnector(connector)
    held.hold("kv/r0/0")
    prefill = PrefillEngine(runner_for(model), held, max_model_len=2048, kv_transfer="whole", **options)
    prefill.add(PrefillTask("r0", chat_ids(tok, QUESTIONS[0]), GREEDY, time.time() + 60))
    results: dict = {}
    step_until(prefill, results, lambda: prefill.num_sending == 1)
    held.wait_entered("kv/r0/0")
    prefill.add(PrefillTask("r1", chat_ids(tok, QUESTIONS[1]), GREEDY, time.time() + 60))
    return held, prefill, results


def kv_of(connector, result) -> torch.Tensor:
    return import_kv(connector, result.outputs.kv_key, result.outputs.kv_handle, timeout=5)


def test_a_held_media_get_does_not_stall_other_prefills(tiny_omni, tmp_path):
    """The media prompt is first in line, its encoder outputs' get is held: the text prompt behind
    it is prefilled and reported meanwhile; once let through, the media prompt's first token and KV
    are exactly those of a run where nothing was held."""
    from transformers import AutoTokenizer

    from omnirelay.gateway.media import MediaLimits, MediaProcessor
    from omnirelay.mrope import MropeSpec
    from omnirelay.workers.encode.engine import EncodeEngine, EncodeResult, EncodeTask, MediaItem, OmniEncoders
    from omnirelay.workers.llm.models.llama import LlamaModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_omni)
    media = MediaProcessor(tiny_omni, MediaLimits())

    def prompt(content):
        messages, items = media.extract([{"role": "user", "content": content}])
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return media.expand(tokenizer(text, add_special_tokens=False)["input_ids"], items), items

    media_ids, items = prompt([image_part(random_png(3, (56, 56))), {"type": "text", "text": "What is this?"}])
    text_ids, _ = prompt([{"type": "text", "text": "Tell me about rivers."}])
    mrope = MropeSpec.from_config(json.loads(open(os.path.join(tiny_omni, "config.json")).read()))
    model = LlamaModel(tiny_omni)
    greedy = TextParams(max_tokens=4, temperature=0.0)
    connector = create_connector("shared_memory", {"shm_dir": str(tmp_path)})
    encoder = EncodeEngine(OmniEncoders(tiny_omni), connector)

    def encoded(rid: str):
        encoder.add(EncodeTask(rid, [MediaItem(m.kind, m.data) for m in items], time.time() + 60))
        (out,) = encoder.step()
        assert isinstance(out, EncodeResult), out
        return out.outputs

    def engine(conn) -> PrefillEngine:
        return PrefillEngine(runner_for(model, block_size=4), conn, max_model_len=4096, max_batched_tokens=64,
                             mrope=mrope)

    try:
        alone = engine(connector)
        alone.add(PrefillTask("m", media_ids, greedy, time.time() + 60, media=encoded("m0")))
        expected: dict = {}
        step_until(alone, expected, lambda: not alone.has_work)
        alone.close()
        want, want_kv = expected["m"], kv_of(connector, expected["m"])   # read (and deleted) before the rerun

        held = HeldConnector(connector)
        handoff = encoded("m1")
        held.hold(handoff.mm_key)
        prefill = engine(held)
        prefill.add(PrefillTask("m", media_ids, greedy, time.time() + 60, media=handoff))
        prefill.add(PrefillTask("t", text_ids, greedy, time.time() + 60))
        results: dict = {}
        step_until(prefill, results, lambda: "t" in results)
        held.wait_entered(handoff.mm_key)
        assert "m" not in results and [t.request_id for t in prefill.waiting] == ["m"]
        assert is_result(results["t"]) and results["t"].outputs.kv_key == "kv/t/0"
        assert prefill.stats["prefill_steps"] >= -(-len(text_ids) // 64)   # the text prompt ran, chunked

        held.let_through()
        step_until(prefill, results, lambda: not prefill.has_work)
        got = results["m"]
        assert is_result(got), got
        assert got.token == want.token and got.outputs.rope_delta == want.outputs.rope_delta
        assert torch.equal(kv_of(connector, got), want_kv)
        kv_of(connector, results["t"])   # imports delete the keys
        prefill.close()
        assert shm_keys(tmp_path) == []   # the encoder outputs were deleted when the prefills ended
    finally:
        connector.close()


@pytest.mark.parametrize("how", ["cancel", "close"])
def test_a_media_prompt_leaving_while_its_get_is_held(tiny_omni, connector, tmp_path, how):
    """Cancelled while its get is in flight: the get runs out, then the fetch deletes the key (the
    request is gone). The worker closing instead keeps the key: the request is handed back to the
    broker, whose retry on another prefill worker reads the same encoder outputs."""
    from omnirelay.handoffs import EmbedsHandoff
    from omnirelay.mrope import MropeSpec
    from omnirelay.workers.llm.models.llama import LlamaModel

    handle = connector.put("mm/c/0", {"image_embeds": torch.zeros(2, 8)})
    held = HeldConnector(connector)
    held.hold("mm/c/0")
    mrope = MropeSpec.from_config(json.loads(open(os.path.join(tiny_omni, "config.json")).read()))
    prefill = PrefillEngine(runner_for(LlamaModel(tiny_omni), block_size=4), held, max_model_len=4096, mrope=mrope)
    try:
        media = EmbedsHandoff("mm/c/0", handle, image_grids=[[1, 2, 4]], audio_lengths=[])
        prefill.add(PrefillTask("c", [mrope.image_token_id] * 2, GREEDY, time.time() + 60, media=media))
        assert outcomes(prefill.step()) == []
        held.wait_entered("mm/c/0")
        if how == "cancel":
            assert prefill.cancel("c") and not prefill.has_work
        else:
            prefill.close()   # returns within CLOSE_JOIN_S; the thread still in the get is left to end
    finally:
        held.let_through()
    held.join_threads()   # the fetch thread discards as its get returns
    prefill.close()
    if how == "close":
        assert len(shm_keys(tmp_path)) == 1 and connector.get("mm/c/0", timeout=0)["image_embeds"].shape == (2, 8)
        connector.delete("mm/c/0")
    assert shm_keys(tmp_path) == []


def test_a_held_kv_handoff_does_not_stall_the_batch(model, tok, connector, tmp_path):
    """r0's whole-KV put is held: r1, admitted after it, is prefilled and reported first; r0 is
    reported once its put returns, with the KV of an engine where nothing was held, and its blocks
    were free while it waited (a whole KV is gathered into connector memory at once)."""
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:2]]
    alone = PrefillEngine(runner_for(model), connector, max_model_len=2048, kv_transfer="whole")
    expected: dict = {}
    alone.add(PrefillTask("r0", prompts[0], GREEDY, time.time() + 60))
    step_until(alone, expected, lambda: not alone.has_work)
    alone.close()
    want_kv = kv_of(connector, expected["r0"])   # read (and deleted) before the rerun puts the same key

    held = HeldConnector(connector)
    held.hold("kv/r0/0")
    prefill = PrefillEngine(runner_for(model), held, max_model_len=2048, kv_transfer="whole", max_batched_tokens=256)
    try:
        prefill.add(PrefillTask("r0", prompts[0], GREEDY, time.time() + 60))
        results: dict = {}
        step_until(prefill, results, lambda: prefill.num_sending == 1)
        held.wait_entered("kv/r0/0")
        assert prefill.allocator.free == prefill.runner.num_blocks - 1   # cached blocks count as free
        prefill.add(PrefillTask("r1", prompts[1], GREEDY, time.time() + 60))
        step_until(prefill, results, lambda: "r1" in results)
        assert "r0" not in results and is_result(results["r1"])
        # r0's first token left as soon as it was sampled: time to first token does not wait for the put.
        assert results["first", "r0"].token == expected["r0"].token
        held.let_through()
        step_until(prefill, results, lambda: not prefill.has_work)
        assert results["r0"].token == expected["r0"].token
        assert torch.equal(kv_of(connector, results["r0"]), want_kv)
        kv_of(connector, results["r1"])
        assert shm_keys(tmp_path) == []
    finally:
        held.let_through()
        prefill.close()


def test_cancel_while_the_handoff_is_held_deletes_it_and_reports_nothing(model, tok, connector, tmp_path):
    """Layerwise: the step's manifest put is held; the request is cancelled meanwhile. Nothing is
    reported for it, every piece and the manifest are deleted, and the blocks the export read come back."""
    held = HeldConnector(connector)
    held.hold("kv/r0/0")   # the manifest, put after every layer's piece
    prefill = PrefillEngine(runner_for(model), held, max_model_len=2048, kv_transfer="layerwise")
    try:
        prefill.add(PrefillTask("r0", chat_ids(tok, QUESTIONS[2]), GREEDY, time.time() + 60))
        results: dict = {}
        step_until(prefill, results, lambda: prefill.num_sending == 1)
        held.wait_entered("kv/r0/0")
        assert prefill.allocator.free < prefill.runner.num_blocks - 1   # held until the export is done
        assert prefill.cancel("r0") and prefill.num_requests == 0
        held.let_through()
        step_until(prefill, results, lambda: not prefill.has_work)
        assert list(results) == [("first", "r0")] and shm_keys(tmp_path) == []
        assert prefill.allocator.free == prefill.runner.num_blocks - 1
    finally:
        held.let_through()
        prefill.close()


def test_close_discards_a_handoff_still_queued(model, tok, connector, tmp_path):
    """One transfer thread, held in r0's put; r1's hand-off waits queued behind it. close() returns
    within its bound, and once r0's put returns nothing of either request is left."""
    held, prefill, results = r0_handoff_held(model, tok, connector, transfer_threads=1)
    try:
        step_until(prefill, results, lambda: prefill.num_sending == 2)
        started = time.monotonic()
        prefill.close()
        assert time.monotonic() - started < 10 and set(results) == {("first", "r0"), ("first", "r1")}
    finally:
        held.let_through()
    held.join_threads()
    assert shm_keys(tmp_path) == []


def test_admission_waits_while_a_batch_of_handoffs_is_stuck(model, tok, connector, tmp_path):
    """max_batch 1: while r0's hand-off is held, r1 is not admitted (a store that stalls must not let
    connector memory pile up); once r0's put returns, r1 is prefilled."""
    held, prefill, results = r0_handoff_held(model, tok, connector, max_batch=1)
    try:
        steps = prefill.stats["prefill_steps"]
        for _ in range(5):
            assert outcomes(prefill.step()) == []
        assert prefill.stats["prefill_steps"] == steps and [t.request_id for t in prefill.waiting] == ["r1"]
        held.let_through()
        step_until(prefill, results, lambda: not prefill.has_work)
        assert sorted(k for k in results if isinstance(k, str)) == ["r0", "r1"]
        for rid in ("r0", "r1"):
            assert is_result(results[rid]) and results[rid].token_sent
            kv_of(connector, results[rid])
        assert shm_keys(tmp_path) == []
    finally:
        held.let_through()
        prefill.close()


def test_wake_ends_a_step_waiting_idle_on_transfers(model, tok, connector, tmp_path):
    """With only a held hand-off pending, step() waits for transfer news; wake() (what the broker
    link calls when a task arrives for the loop) ends that wait at once, so the task is read now."""
    held = HeldConnector(connector)
    held.hold("kv/r0/0")
    prefill = PrefillEngine(runner_for(model), held, max_model_len=2048, kv_transfer="whole")
    prefill.IDLE_WAIT_S = 120.0   # longer than any test: only wake() or news can end the wait
    try:
        prefill.add(PrefillTask("r0", chat_ids(tok, QUESTIONS[0]), GREEDY, time.time() + 60))
        results: dict = {}
        step_until(prefill, results, lambda: prefill.num_sending == 1)
        held.wait_entered("kv/r0/0")
        stepper = threading.Thread(target=prefill.step, name="test-step")
        stepper.start()
        stepper.join(0.5)
        assert stepper.is_alive()   # waiting for the held put's news
        prefill.wake()
        stepper.join(10)
        assert not stepper.is_alive()
    finally:
        held.let_through()
        prefill.close()
    held.join_threads()
    assert shm_keys(tmp_path) == []   # the hand-off nobody collected was discarded by close()


@pytest.mark.parametrize("kv_transfer", ["whole", "layerwise"])
def test_on_shared_memory_the_handoff_is_reported_in_the_step_that_sampled_it(model, tok, connector, kv_transfer):
    """Shared memory's writes are local (Connector.local_writes): the pool publishes the hand-off
    inline, so the step that samples a first token also reports the request, no transfer is left
    pending, no thread is started, and decode can read the KV at once."""
    prefill = PrefillEngine(runner_for(model), connector, max_model_len=2048, kv_transfer=kv_transfer,
                            max_batched_tokens=2048)
    try:
        prefill.add(PrefillTask("r0", chat_ids(tok, QUESTIONS[0]), GREEDY, time.time() + 60))
        step = outcomes(prefill.step())
        assert [is_first_token(o) for o in step] == [True, False] and is_result(step[1])
        assert step[1].token_sent and step[1].token == step[0].token
        assert not prefill.has_work and prefill._transfers.num_pending == 0 and not prefill._transfers._workers
        assert kv_of(connector, step[1]).shape[2] == len(chat_ids(tok, QUESTIONS[0]))
    finally:
        prefill.close()
