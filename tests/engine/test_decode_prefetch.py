"""Decode's KV prefetch (workers/kv/prefetch.py): a slow KV import no longer stalls the running batch.

No network: real prefill and decode engines in this process, the real shared-memory connector in a
private directory between them. The decode side reads through :class:`HeldConnector`, which forwards to
that connector but can hold the gets of chosen keys until the test lets them through, so "while an
import is pending" is a state the test controls: progress is counted in steps and tokens, never
timed.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from omnirelay.connectors import create_connector
from omnirelay.handoffs import SpeechHandoff, piece_key
from omnirelay.workers.llm.decode import DecodeEngine, DecodeTask
from omnirelay.workers.kv.cache import PagedKVCache
from omnirelay.workers.runtime.transfers import TransferPool, TransferState
from omnirelay.workers.llm.model_runner import LocalRunner
from omnirelay.workers.llm.prefill import PrefillEngine
from omnirelay.request_params import TextParams

from held_connector import HeldConnector
from engine_support import (  # noqa: F401  (fixtures)
    GREEDY, QUESTIONS, chat_ids, connector, model, reference, run_prefill, runner_for, shm_keys, tok)


def make_decode(model, connector, *, max_num_seqs: int = 16, num_blocks: int = 256) -> DecodeEngine:
    cfg = model.config
    cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=16, num_blocks=num_blocks)
    return DecodeEngine(LocalRunner(model, cache), connector, max_num_seqs=max_num_seqs, max_model_len=2048,
                        transfer_timeout_s=5)


def prefill(model, connector, prompts, mode: str = "whole") -> dict:
    engine = PrefillEngine(runner_for(model), connector, max_model_len=2048, kv_transfer=mode)
    return run_prefill(engine, prompts)


def task(rid: str, ids: list[int], result) -> DecodeTask:
    return DecodeTask(rid, ids, result.token, GREEDY, time.time() + 60, "", result.outputs.kv_key,
                      result.outputs.kv_handle)


def is_running(engine: DecodeEngine, rid: str) -> bool:
    return any(s.request_id == rid for s in engine.running)


def waiting_seq(engine: DecodeEngine, rid: str):
    return next(s for s in engine.waiting if s.request_id == rid)


def step_until(engine: DecodeEngine, outputs: dict, done, max_steps: int = 500) -> list:
    failed = []
    for _ in range(max_steps):
        out = engine.step()
        failed += out.failed
        for token in out.tokens:
            outputs[token.request_id].append(token.token)
        if done():
            return failed
    raise AssertionError("the engine did not get there")


def assert_transformers_outputs_and_no_key_left(outputs, prompts, reference, tmp_path) -> None:
    for i, ids in enumerate(prompts):
        assert outputs[f"r{i}"] == reference(ids), QUESTIONS[i]
    assert shm_keys(tmp_path) == []


def test_running_sequence_keeps_stepping_while_another_kv_import_is_held(model, tok, reference, connector, tmp_path):
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:2]]
    prefilled = prefill(model, connector, prompts)
    held = HeldConnector(connector)
    engine = make_decode(model, held)
    outputs = {f"r{i}": [prefilled[f"r{i}"].token] for i in range(2)}
    try:
        engine.add(task("r0", prompts[0], prefilled["r0"]))
        step_until(engine, outputs, lambda: is_running(engine, "r0"))
        b_key = prefilled["r1"].outputs.kv_key
        held.hold(b_key)
        engine.add(task("r1", prompts[1], prefilled["r1"]))
        out = engine.step()   # hands r1's import to a thread
        assert [t.request_id for t in out.tokens] == ["r0"]
        outputs["r0"].append(out.tokens[0].token)
        held.wait_entered(b_key)
        # r1's get is blocked: every step still produces r0's next token.
        steps_while_held = 6
        for _ in range(steps_while_held):
            out = engine.step()
            assert [t.request_id for t in out.tokens] == ["r0"] and not out.failed
            outputs["r0"].append(out.tokens[0].token)
            assert waiting_seq(engine, "r1").fetch.state is TransferState.RUNNING
            assert engine.stats["kv_imports_inflight"] == 1
        held.let_through(b_key)
        failed = step_until(engine, outputs, lambda: not engine.has_work)
        assert not failed
    finally:
        held.let_through()
        engine.close()
    assert engine.stats["kv_loads"] == 2 and engine.stats["kv_imports_inflight"] == 0
    assert_transformers_outputs_and_no_key_left(outputs, prompts, reference, tmp_path)
    assert not any(t.is_alive() for t in held.threads)   # close() joined the import threads


def test_greedy_output_with_a_held_import_equals_transformers(model, tok, reference, connector, tmp_path):
    """The same scenario, recording every token: both streams equal transformers'."""
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:3]]
    prefilled = prefill(model, connector, prompts, mode="layerwise")
    held = HeldConnector(connector)
    engine = make_decode(model, held)
    outputs = {f"r{i}": [prefilled[f"r{i}"].token] for i in range(3)}
    try:
        engine.add(task("r0", prompts[0], prefilled["r0"]))
        step_until(engine, outputs, lambda: is_running(engine, "r0"))
        slow = piece_key(prefilled["r1"].outputs.kv_key, 1)   # r1's layerwise KV: its second piece is late
        held.hold(slow)
        engine.add(task("r1", prompts[1], prefilled["r1"]))
        engine.add(task("r2", prompts[2], prefilled["r2"]))   # arrives later, but its KV is there: admitted first
        step_until(engine, outputs, lambda: held.entered[slow].is_set() and is_running(engine, "r2"))
        for _ in range(4):   # r1's import is stuck on a piece: the others keep producing tokens
            out = engine.step()
            for token in out.tokens:
                outputs[token.request_id].append(token.token)
            assert out.tokens and "r1" not in {t.request_id for t in out.tokens}
        assert waiting_seq(engine, "r1").fetch.state is TransferState.RUNNING
        held.let_through()
        assert not step_until(engine, outputs, lambda: not engine.has_work)
    finally:
        held.let_through()
        engine.close()
    assert_transformers_outputs_and_no_key_left(outputs, prompts, reference, tmp_path)


@pytest.mark.parametrize("mode", ["whole", "layerwise"])
def test_cancel_while_the_import_is_in_flight_leaves_no_key(model, tok, connector, tmp_path, mode):
    prompts = [chat_ids(tok, QUESTIONS[2])]
    result = prefill(model, connector, prompts, mode=mode)["r0"]
    key = result.outputs.kv_key
    layers = model.config.num_layers
    assert len(shm_keys(tmp_path)) == (1 if mode == "whole" else layers + 1)
    held = HeldConnector(connector)
    gated = key if mode == "whole" else piece_key(key, 1)
    held.hold(gated)
    engine = make_decode(model, held)
    try:
        engine.add(task("r0", prompts[0], result))
        assert not engine.step().failed
        held.wait_entered(gated)
        assert engine.cancel("r0") and not engine.has_work
        held.let_through()
    finally:
        held.let_through()
        engine.close()   # joins the import thread: it has returned and dropped its result
    assert shm_keys(tmp_path) == []
    if mode == "layerwise":   # pieces 0 and 1 were read; the rest were deleted unread
        assert [k for k in held.gets if k != key] == [piece_key(key, 0), piece_key(key, 1)]


def test_deadline_while_the_import_is_in_flight_leaves_no_key(model, tok, connector, tmp_path):
    prompts = [chat_ids(tok, QUESTIONS[1])]
    result = prefill(model, connector, prompts)["r0"]
    held = HeldConnector(connector)
    held.hold(result.outputs.kv_key)
    engine = make_decode(model, held)
    try:
        t = task("r0", prompts[0], result)
        engine.add(t)
        engine.step()
        held.wait_entered(result.outputs.kv_key)
        engine.waiting.head.task.deadline = time.time() - 1
        out = engine.step()
        assert [(f.request_id, f.error_type) for f in out.failed] == [("r0", "deadline_exceeded")] and not engine.has_work
    finally:
        held.let_through()
        engine.close()
    assert shm_keys(tmp_path) == []


def test_import_error_fails_only_that_request(model, tok, reference, connector, tmp_path):
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:2]]
    prefilled = prefill(model, connector, prompts)
    # The decode side's own connector on the same directory; its 2nd get fails (r1's import).
    faulty = create_connector("fault_injection", {"inner": "shared_memory", "inner_options": {"shm_dir": str(tmp_path)},
                                                  "fail_every_nth_get": 2})
    engine = make_decode(model, faulty)
    outputs = {f"r{i}": [prefilled[f"r{i}"].token] for i in range(2)}
    try:
        engine.add(task("r0", prompts[0], prefilled["r0"]))
        assert not step_until(engine, outputs, lambda: is_running(engine, "r0"))
        engine.add(task("r1", prompts[1], prefilled["r1"]))
        failed = step_until(engine, outputs, lambda: not engine.has_work)
    finally:
        engine.close()
        faulty.close()
    assert [(f.request_id, f.error_type) for f in failed] == [("r1", "transfer_failed")]
    assert "failed on purpose" in failed[0].message
    assert outputs["r0"] == reference(prompts[0]) and outputs["r1"] == [prefilled["r1"].token]
    assert engine.stats["kv_loads"] == 1
    assert shm_keys(tmp_path) == []   # r1's KV was released when its import failed


@pytest.mark.parametrize("mode", ["whole", "layerwise"])
def test_failed_import_releases_its_keys_and_the_speech_key(model, tok, connector, tmp_path, mode):
    """A request whose import failed is restarted from prefill under a new attempt (new keys) or
    failed: this attempt's KV and speech prompt states will never be read, and are deleted."""
    prompts = [chat_ids(tok, QUESTIONS[1])]
    result = prefill(model, connector, prompts, mode=mode)["r0"]
    key = result.outputs.kv_key
    speech_key = "speech/r0/0/prompt"
    speech_handle = connector.put(speech_key, {"hidden": torch.zeros(2, 4)})
    assert len(shm_keys(tmp_path)) == (2 if mode == "whole" else model.config.num_layers + 2)
    held = HeldConnector(connector)
    held.fail_once(key)   # the manifest's get, for a layerwise KV: its pieces are still there after it
    engine = make_decode(model, held)
    try:
        t = task("r0", prompts[0], result)
        t.speech_inputs = SpeechHandoff(speech_key, speech_handle)
        engine.add(t)
        outputs = {"r0": [result.token]}
        failed = step_until(engine, outputs, lambda: not engine.has_work)
        # By the time the failure is reported, the KV is gone (released before the import is FAILED);
        # the speech key's delete is on its way on a transfer thread (close() joins it).
        assert [(f.request_id, f.error_type) for f in failed] == [("r0", "transfer_failed")] and "on purpose" in failed[0].message
    finally:
        engine.close()
    held.join_threads()
    assert shm_keys(tmp_path) == []
    assert outputs["r0"] == [result.token] and engine.stats["kv_loads"] == 0


def test_a_blocked_delete_does_not_stall_the_batch(model, tok, reference, connector, tmp_path):
    """A cancelled speech request's states are deleted on a transfer thread: with that delete
    blocked (a store that hangs), the running sequence still gets a token every step."""
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:2]]
    prefilled = prefill(model, connector, prompts)
    speech_key = "speech/r1/0/prompt"
    speech_handle = connector.put(speech_key, {"hidden": torch.zeros(2, 4)})
    held = HeldConnector(connector)
    held.hold_delete(speech_key)
    engine = make_decode(model, held)
    outputs = {f"r{i}": [prefilled[f"r{i}"].token] for i in range(2)}
    try:
        engine.add(task("r0", prompts[0], prefilled["r0"]))
        spoken = task("r1", prompts[1], prefilled["r1"])
        spoken.speech_inputs = SpeechHandoff(speech_key, speech_handle)
        engine.add(spoken)
        step_until(engine, outputs, lambda: is_running(engine, "r0") and is_running(engine, "r1"))
        assert engine.cancel("r1")
        held.wait_entered(speech_key)
        for _ in range(6):   # the delete is blocked: every step still makes r0's next token
            out = engine.step()
            assert [t.request_id for t in out.tokens] == ["r0"] and not out.failed
            outputs["r0"].append(out.tokens[0].token)
        assert len(shm_keys(tmp_path)) == 1   # the speech states: their delete waits
        held.let_through(speech_key)
        assert not step_until(engine, outputs, lambda: not engine.has_work)
    finally:
        held.let_through()
        engine.close()
    held.join_threads()
    assert outputs["r0"] == reference(prompts[0]) and shm_keys(tmp_path) == []


def test_imports_beyond_max_num_seqs_wait_queued(model, tok, reference, connector, tmp_path):
    """At most max_num_seqs KVs are held imported-or-importing; the next import starts when one leaves."""
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:3]]
    prefilled = prefill(model, connector, prompts)
    keys = [prefilled[f"r{i}"].outputs.kv_key for i in range(3)]
    held = HeldConnector(connector)
    for key in keys[:2]:
        held.hold(key)
    engine = make_decode(model, held, max_num_seqs=2)
    outputs = {f"r{i}": [prefilled[f"r{i}"].token] for i in range(3)}
    try:
        for i in range(3):
            engine.add(task(f"r{i}", prompts[i], prefilled[f"r{i}"]))
        engine.step()
        for key in keys[:2]:
            held.wait_entered(key)
        # Nothing runs and only imports are pending: a step waits for one instead of spinning.
        started = time.monotonic()
        for _ in range(3):
            assert not engine.step().tokens
        assert time.monotonic() - started >= 2 * DecodeEngine.IDLE_WAIT_S
        assert waiting_seq(engine, "r2").fetch.state is TransferState.QUEUED and keys[2] not in held.gets
        assert engine.stats["kv_imports_inflight"] == 3
        held.let_through()
        assert not step_until(engine, outputs, lambda: not engine.has_work)
    finally:
        held.let_through()
        engine.close()
    assert_transformers_outputs_and_no_key_left(outputs, prompts, reference, tmp_path)


def test_close_cancels_queued_imports_and_joins_the_threads(model, tok, connector, tmp_path):
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:2]]
    prefilled = prefill(model, connector, prompts)
    keys = [prefilled[f"r{i}"].outputs.kv_key for i in range(2)]
    held = HeldConnector(connector)
    held.hold(keys[0])
    engine = make_decode(model, held, max_num_seqs=1)   # r1's import waits behind r0's
    engine.add(task("r0", prompts[0], prefilled["r0"]))
    engine.add(task("r1", prompts[1], prefilled["r1"]))
    engine.step()
    held.wait_entered(keys[0])
    queued = waiting_seq(engine, "r1").fetch
    assert queued.state is TransferState.QUEUED
    closer = threading.Thread(target=engine.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()   # waits for r0's get, which it cannot interrupt
    held.let_through()
    closer.join(10)
    assert not closer.is_alive() and not any(t.is_alive() for t in held.threads)
    # r1's import never started; close() released its key (one get without waiting, then delete).
    assert queued.state is TransferState.CANCELLED and held.gets.count(keys[1]) == 1
    assert shm_keys(tmp_path) == []
    engine.close()   # idempotent


def test_close_does_not_wait_out_a_blocked_release_of_a_queued_import(model, tok, connector, tmp_path):
    """Releasing a queued import's keys is a connector call that can block (a store that went
    down); close() still returns within CLOSE_JOIN_S, and the release finishes when the call returns."""
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:2]]
    prefilled = prefill(model, connector, prompts)
    keys = [prefilled[f"r{i}"].outputs.kv_key for i in range(2)]
    held = HeldConnector(connector)
    held.hold(keys[0])
    held.hold(keys[1])   # the release's get of r1's key blocks too
    engine = make_decode(model, held, max_num_seqs=1)
    try:
        engine.add(task("r0", prompts[0], prefilled["r0"]))
        engine.add(task("r1", prompts[1], prefilled["r1"]))
        engine.step()
        held.wait_entered(keys[0])
        started = time.monotonic()
        engine.close()
        waited = time.monotonic() - started
        assert TransferPool.CLOSE_JOIN_S * 0.9 <= waited < TransferPool.CLOSE_JOIN_S + 2
        held.wait_entered(keys[1])   # the release had started: it was waiting in its get
        assert waiting_seq(engine, "r1").fetch.state is TransferState.CANCELLED
    finally:
        held.let_through()
    held.join_threads()
    assert shm_keys(tmp_path) == []


def test_close_does_not_wait_out_a_get_in_progress(model, tok, tmp_path, connector):
    """close() joins for at most CLOSE_JOIN_S; the thread still inside a get is left to it and, once
    the get returns, only releases the import's keys (the connector closed meanwhile) and ends."""
    prompts = [chat_ids(tok, QUESTIONS[2])]
    result = prefill(model, connector, prompts, mode="layerwise")["r0"]
    key = result.outputs.kv_key
    decode_side = create_connector("shared_memory", {"shm_dir": str(tmp_path)})   # the decode worker's own
    held = HeldConnector(decode_side)
    gated = piece_key(key, 1)
    held.hold(gated)
    engine = make_decode(model, held)
    unhandled: list = []
    hook, threading.excepthook = threading.excepthook, unhandled.append
    try:
        engine.add(task("r0", prompts[0], result))
        engine.step()
        held.wait_entered(gated)
        (thread,) = held.threads
        assert thread.daemon   # a thread close() gave up on does not keep the process alive
        started = time.monotonic()
        engine.close()
        waited = time.monotonic() - started
        assert TransferPool.CLOSE_JOIN_S * 0.9 <= waited < 5 and thread.is_alive()
        decode_side.close()   # what the owner does right after
        held.let_through()
        thread.join(10)
        assert not thread.is_alive() and not unhandled
    finally:
        threading.excepthook = hook
        held.let_through()
        engine.close()
        decode_side.close()
    # Pieces 0 and 1 were read, none after; every key was deleted (a shared-memory consumer's delete
    # works on a closed connector too).
    assert [k for k in held.gets if k != key] == [piece_key(key, 0), gated]
    assert shm_keys(tmp_path) == []


def test_a_held_speech_reply_put_does_not_stall_the_batch(model, tok, reference, connector, tmp_path):
    """r0 speaks its reply: when it finishes, its states' put is held. r1 keeps decoding meanwhile
    and r0's last token is reported only with its hand-off, once the put returns; a cancelled
    spoken reply whose put is held leaves nothing behind."""
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:3]]
    prefilled = prefill(model, connector, prompts)
    held = HeldConnector(connector)
    engine = make_decode(model, held)
    try:
        speaking = {}
        for rid in ("r0", "r2"):
            prompt_key = f"speech/{rid}/0/prompt"
            held.hold(f"speech/{rid}/0/reply")
            t = task(rid, prompts[int(rid[1])], prefilled[rid])
            t.params = TextParams(max_tokens=3, temperature=0, ignore_eos=True)
            t.speech_inputs = SpeechHandoff(prompt_key, connector.put(prompt_key, {"hidden": torch.zeros(2, 4)}))
            speaking[rid] = t
        engine.add(speaking["r0"])
        engine.add(task("r1", prompts[1], prefilled["r1"]))
        outputs = {rid: [prefilled[rid].token] for rid in ("r0", "r1", "r2")}
        finished = []

        def step_collecting(done):
            for _ in range(500):
                out = engine.step()
                assert not out.failed, out.failed
                for token in out.tokens:
                    outputs[token.request_id].append(token.token)
                    if token.finish_reason:
                        finished.append(token)
                if done():
                    return
            raise AssertionError("the engine did not get there")

        step_collecting(lambda: held.entered["speech/r0/0/reply"].is_set())
        tokens_before = len(outputs["r1"])
        step_collecting(lambda: len(outputs["r1"]) >= tokens_before + 4)   # r1 decodes on
        assert len(outputs["r0"]) == 2 and not finished   # r0's last token waits for its states
        held.let_through("speech/r0/0/reply")
        step_collecting(lambda: not engine.has_work)
        (spoken,) = [t for t in finished if t.request_id == "r0"]
        assert spoken.outputs.speech_reply_key == "speech/r0/0/reply" and len(outputs["r0"]) == 3
        assert held.get("speech/r0/0/reply", spoken.outputs.speech_reply_handle)["token_ids"] == outputs["r0"]
        assert outputs["r1"] == reference(prompts[1])
        spoken.outputs.release(connector)

        engine.add(speaking["r2"])
        step_collecting(lambda: held.entered["speech/r2/0/reply"].is_set())
        assert engine.cancel("r2") and engine.num_requests == 0
        held.let_through()
        step_collecting(lambda: not engine.has_work)
        assert not [t for t in finished if t.request_id == "r2"]
        assert shm_keys(tmp_path) == []
    finally:
        held.let_through()
        engine.close()
