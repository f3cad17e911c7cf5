"""A task sent again to the worker that holds it is held once: the new attempt replaces the old
(issue #28). The broker sends a request again to the same worker when it re-dispatches it (a worker
that re-registered, a restart of the request); the prefill and decode adapters used to queue the
second copy beside the first, so the request ran twice and reported twice.

Real engines on the tiny model, driven through their role adapters as the worker loop drives them.
"""

from __future__ import annotations

import time

from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams
from omnirelay.handoffs import KVHandoff
from omnirelay.workers.llm.decode import DecodeEngine
from omnirelay.workers.llm.prefill import PrefillEngine
from omnirelay.workers.runtime.roles import BROKER
from omnirelay.workers.llm.roles import DecodeRole, PrefillRole

from engine_support import (  # noqa: F401  (fixtures)
    connector, decode_engine, model, runner_for)

GW = "tcp://127.0.0.1:5001"
PROMPT = [1, 5, 9, 14, 3, 7, 2, 11]
SAMPLING = TextParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _task(stage: str, attempt: int, inputs=None) -> p.Task:
    return p.Task("r1", stage, "tiny-llm", PROMPT, SAMPLING, inputs, GW, time.time() + 60, attempt=attempt)


def _drain(role, max_steps: int = 500) -> list:
    out = []
    for _ in range(max_steps):
        out += role.step()
        if not role.engine.has_work:
            return out
    raise AssertionError("the engine did not finish")


def _tokens(out: list) -> list[tuple[int, int]]:
    """(position, token) of every token pushed to the gateway."""
    deltas = []
    for dest, msg in out:
        if dest == GW:
            deltas += msg.deltas if isinstance(msg, p.TokenDeltas) else [msg]
    return [(d.start + i, t) for d in deltas for i, t in enumerate(d.token_ids)]


def _reports(out: list) -> list:
    return [msg for dest, msg in out if dest == BROKER]


def _prefill(model, connector) -> PrefillRole:  # noqa: F811
    return PrefillRole("pre-1", PrefillEngine(runner_for(model), connector, max_model_len=2048))


def test_prefill_holds_a_task_sent_twice_once(model, connector):  # noqa: F811
    role = _prefill(model, connector)
    assert role.accept(_task("prefill", 0)) == []
    assert role.accept(_task("prefill", 1)) == []
    assert role.engine.num_requests == 1
    out = _drain(role)
    reports = _reports(out)
    assert [(type(m), m.request_id, m.attempt) for m in reports] == [(p.StageDone, "r1", 1)]
    assert [pos for pos, _ in _tokens(out)] == [0]   # one first token, not two
    reports[0].outputs.release(connector)


def test_decode_holds_a_task_sent_twice_once(model, connector):  # noqa: F811
    prefill = _prefill(model, connector)
    handoffs = []
    for attempt in (0, 1):   # each attempt's prefill leaves its own KV
        prefill.accept(_task("prefill", attempt))
        handoffs.append(_reports(_drain(prefill))[0].outputs)
    assert all(isinstance(h, KVHandoff) for h in handoffs) and handoffs[0].kv_key != handoffs[1].kv_key

    role = DecodeRole("dec-1", decode_engine(model, connector, num_blocks=64))
    assert isinstance(role.engine, DecodeEngine)
    assert role.accept(_task("decode", 0, handoffs[0])) == []
    assert role.accept(_task("decode", 1, handoffs[1])) == []
    assert role.engine.num_requests == 1
    out = _drain(role)
    positions = [pos for pos, _ in _tokens(out)]
    assert positions == list(range(1, SAMPLING.max_tokens)), positions   # each position once
    assert [(type(m), m.request_id, m.attempt, m.finished) for m in _reports(out)] == [(p.StageDone, "r1", 1, True)]
