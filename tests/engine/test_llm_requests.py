"""The LLM engines' request record (``workers/llm/requests.py``): a request's status says where it is
as it crosses the prefill and decode engines, ``cancel`` is one lookup by id that undoes what its
status holds, and an engine holds one request per id.

Real engines on the tiny model over shared memory; a held connector keeps a prefill hand-off on its
way.
"""

from __future__ import annotations

import time

import pytest

from omnirelay.workers.llm.decode import DecodeTask
from omnirelay.workers.llm.prefill import PrefillEngine, PrefillTask
from omnirelay.workers.llm.requests import Status

from engine_support import (  # noqa: F401  (fixtures)
    GREEDY, QUESTIONS, chat_ids, connector, decode_engine, is_first_token, model, outcomes, run_prefill, runner_for,
    shm_keys, tok)
from held_connector import HeldConnector


def test_prefill_statuses_and_a_cancel_while_the_handoff_is_on_its_way(model, tok, connector, tmp_path):
    """WAITING → RUNNING → SENDING_HANDOFF (first token reported, blocks given back); a cancel then
    makes it CANCELLED at once, out of the registry, and what its put wrote is deleted when it returns."""
    held = HeldConnector(connector)
    held.hold("kv/r0/0")
    prefill = PrefillEngine(runner_for(model), held, max_model_len=2048, kv_transfer="whole", max_batched_tokens=8)
    try:
        prefill.add(PrefillTask("r0", chat_ids(tok, QUESTIONS[0]), GREEDY, time.time() + 60))
        request = prefill.requests.get("r0")
        assert request.status is Status.WAITING and prefill.num_requests == 1
        seen, reported = set(), []
        for _ in range(200):   # 8 tokens a step: several RUNNING steps (chunked prefill)
            reported += outcomes(prefill.step())
            seen.add(request.status)
            if prefill.num_sending == 1:
                break
        assert Status.RUNNING in seen and request.status is Status.SENDING_HANDOFF
        assert [is_first_token(o) for o in reported] == [True]   # the first token left before its hand-off
        assert request.blocks == [] and prefill.num_requests == 0
        held.wait_entered("kv/r0/0")
        assert prefill.cancel("r0") and request.status is Status.CANCELLED and "r0" not in prefill.requests
        assert not prefill.cancel("r0")   # gone: nothing left to undo
        held.let_through()
        late = []
        for _ in range(400):
            late += outcomes(prefill.step())
            if not prefill.has_work:
                break
        assert late == [] and not prefill.has_work   # nothing reported for a cancelled request
    finally:
        held.let_through()
        prefill.close()
    held.join_threads()
    assert shm_keys(tmp_path) == []   # the hand-off nobody will read was deleted


def test_decode_statuses_cancel_and_one_request_per_id(model, tok, connector, tmp_path):
    """A decode request runs (RUNNING) once its KV is in; a cancel gives its blocks back and takes it
    out of the registry; a second add of a held id is refused by name (the role replaces, never
    duplicates)."""
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:2]]
    prefilled = run_prefill(PrefillEngine(runner_for(model), connector, max_model_len=2048), prompts)
    engine = decode_engine(model, connector, num_blocks=64)
    free = engine.allocator.free
    tasks = {rid: DecodeTask(rid, prompts[i], prefilled[rid].token, GREEDY, time.time() + 60, "",
                             prefilled[rid].outputs.kv_key, prefilled[rid].outputs.kv_handle)
             for i, rid in enumerate(("r0", "r1"))}
    for task in tasks.values():
        engine.add(task)
    assert [engine.requests.get(rid).status for rid in tasks] == [Status.WAITING, Status.WAITING]
    with pytest.raises(ValueError, match="'r0'"):
        engine.add(tasks["r0"])
    for _ in range(200):
        out = engine.step()
        assert not out.failed, out.failed
        if len(engine.running) == 2:
            break
    r0 = engine.requests.get("r0")
    assert r0.status is Status.RUNNING and r0.blocks and engine.num_requests == 2
    assert engine.cancel("r0") and r0.status is Status.CANCELLED and "r0" not in engine.requests
    assert not engine.cancel("r0") and engine.num_requests == 1 and r0 not in engine.running
    tokens = []
    for _ in range(200):
        tokens += [t for t in engine.step().tokens]
        if not engine.has_work:
            break
    assert {t.request_id for t in tokens} == {"r1"} and tokens[-1].done and tokens[-1].finish_reason == "length"
    assert engine.allocator.free == free and len(engine.requests) == 0
    engine.close()
    assert shm_keys(tmp_path) == []
