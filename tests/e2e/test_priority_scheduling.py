"""``--scheduling-policy priority`` (omnirelay/scheduling.py): the broker's role queues and the
engines' waiting queues serve the lowest ``priority`` first, FIFO among equals, aged so nobody
starves; ``fcfs`` keeps arrival order. The broker is the real ``BrokerCore`` driven with fake
identities and chosen times (as tests/unit/test_broker.py); the end-to-end test is below."""

from __future__ import annotations

import collections
import dataclasses

import openai
import pytest

from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams
from omnirelay.broker.config import BrokerConfig
from omnirelay.broker.core import BrokerCore
from omnirelay.scheduling import PRIORITY_AGING_S
from omnirelay.workers.runtime.request_queue import RequestQueue

from conftest import ServeProcess

MODEL, GW, FAR = "tiny", b"gw", 1e12
BATCH = 4   # the prefill worker's capacity: what it runs at once


def make_core(policy: str) -> BrokerCore:
    core = BrokerCore(BrokerConfig(endpoint="ipc:///unused", max_queue_per_role=1024, scheduling_policy=policy))
    core.on_message(b"pre", p.Register("pre", "prefill", MODEL, BATCH), 0.0)
    return core


def submit(core: BrokerCore, request_id: str, priority: int, now: float) -> list:
    return core.on_message(GW, p.Submit(request_id, MODEL, ["prefill"], [1, 2], TextParams(), FAR, "tcp://gw:7000",
                                        priority=priority), now)


def tasks(out: list) -> list[p.Task]:
    return [msg for _, msg in out if isinstance(msg, p.Task)]


def run_flood(policy: str) -> tuple[list[str], list[p.Task]]:
    """100 requests of priority 10 fill the worker's batch and its queue; one of priority 0 arrives
    last; then the worker finishes one task at a time (one credit back each). Returns the dispatch
    order and the tasks sent."""
    core = make_core(policy)
    for i in range(100):
        submit(core, f"low{i}", 10, now=1.0 + i * 1e-3)
    submit(core, "high", 0, now=2.0)
    sent = tasks(core.on_message(b"pre", p.Credit("pre", BATCH), 2.0))   # the first batch
    running = collections.deque(t.request_id for t in sent)
    for _ in range(200):   # bounded: one task finished, one credit back, per turn
        if not running:
            break
        finished = running.popleft()
        core.on_message(b"pre", p.StageDone("pre", finished, "prefill", finished=True), 2.0)
        new = tasks(core.on_message(b"pre", p.Credit("pre", 1), 2.0))
        sent += new
        running.extend(t.request_id for t in new)
    return [t.request_id for t in sent], sent


def test_a_high_priority_request_waits_at_most_one_batch_behind_a_low_priority_flood():
    order, sent = run_flood("priority")
    assert len(order) == 101 and len(set(order)) == 101
    # It arrived after all 100 and after the first batch was formed: it is next once that batch frees room.
    assert order.index("high") <= BATCH
    assert order[:BATCH] != ["high"] and [i for i in order if i != "high"] == [f"low{i}" for i in range(100)]
    assert next(t for t in sent if t.request_id == "high").priority == 0
    assert {t.priority for t in sent if t.request_id != "high"} == {10}   # the engine orders by it too


def test_fcfs_keeps_arrival_order_and_sends_no_priority():
    order, sent = run_flood("fcfs")
    assert order == [f"low{i}" for i in range(100)] + ["high"]
    assert {t.priority for t in sent} == {0}


def test_waiting_ages_a_request_so_a_stream_of_urgent_ones_cannot_starve_it():
    core = make_core("priority")
    submit(core, "old", 5, now=0.0)
    # Priority 0 arriving after 5 aging periods and more no longer passes it; earlier ones do.
    submit(core, "early", 0, now=5 * PRIORITY_AGING_S - 0.5)
    submit(core, "late", 0, now=5 * PRIORITY_AGING_S + 0.5)
    out = core.on_message(b"pre", p.Credit("pre", 3), 10.0)
    assert [t.request_id for t in tasks(out)] == ["early", "old", "late"]


def test_fifo_among_equal_priorities_and_cancel_of_a_queued_one():
    core = make_core("priority")
    for i, prio in enumerate([3, 1, 3, 1, 2]):
        submit(core, f"r{i}", prio, now=float(i) * 1e-3)
    core.on_message(GW, p.Cancel("r3"), 1.0)
    assert list(core.queues[(MODEL, "prefill")]) == ["r1", "r4", "r0", "r2"]
    assert core.status(1.0).queued == {f"{MODEL}/prefill": 4}
    out = core.on_message(b"pre", p.Credit("pre", 4), 1.0)
    assert [t.request_id for t in tasks(out)] == ["r1", "r4", "r0", "r2"]


def test_a_restarted_request_goes_ahead_of_everything_queued():
    core = make_core("priority")
    core.on_message(b"pre", p.Credit("pre", 1), 0.0)
    submit(core, "first", 9, now=0.0)            # dispatched at once
    submit(core, "urgent", -5, now=0.1)
    # A failed transfer: back to the queue after the retry delay, ahead of what came after it.
    core.on_message(b"pre", p.StageFailed("pre", "first", "prefill", "transfer_failed", "store down"), 0.2)
    assert not tasks(core.tick(0.2 + core.config.retry_backoff_s + 0.01))
    out = core.on_message(b"pre", p.Credit("pre", 1), 1.0)
    assert [t.request_id for t in tasks(out)] == ["first"]


def test_broker_config_refuses_an_unknown_policy():
    with pytest.raises(ValueError, match="scheduling policy"):
        BrokerConfig(scheduling_policy="lifo")


@dataclasses.dataclass
class Job:
    request_id: str
    priority: int = 0
    deadline: float = FAR


def test_engine_queue_orders_by_priority_fifo_within_and_keeps_the_front_for_preempted():
    queue: RequestQueue[Job] = RequestQueue()
    clock = iter(float(i) * 1e-3 for i in range(100))
    queue.now = lambda: next(clock)   # arrival times we choose
    for name, prio in [("a", 0), ("b", 5), ("c", 0), ("d", -1), ("e", 5)]:
        queue.add(Job(name, prio))
    queue.appendleft(Job("pre", 9))   # preempted: goes first, whatever its priority
    assert [j.request_id for j in queue] == ["pre", "d", "a", "c", "b", "e"]
    assert queue.popleft().request_id == "pre"
    assert [j.request_id for j in queue.take_batch(10, key=lambda j: j.priority == 0 or j.priority == -1)] == \
        ["d", "a", "c"]
    assert [j.request_id for j in queue] == ["b", "e"]


def test_engine_queue_ages_a_waiting_task():
    queue: RequestQueue[Job] = RequestQueue()
    times = iter([0.0, 3 * PRIORITY_AGING_S + 0.5])
    queue.now = lambda: next(times)
    queue.add(Job("old", 3))
    queue.add(Job("new", 0))   # arrived after 3 aging periods: behind the old one
    assert [j.request_id for j in queue] == ["old", "new"]


# ---------------------------------------------------------------- end to end, official client


def test_fcfs_server_refuses_a_non_zero_priority_as_vllm_does(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny-llm", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, extra_body={"priority": 1})
    assert caught.value.body["param"] == "priority" and "Priority scheduling is not enabled" in caught.value.message
    # 0 is every request's priority under fcfs: served as if absent.
    answer = client.completions.create(model="tiny-llm", prompt="hi", max_tokens=2, temperature=0,
                                       extra_body={"priority": 0})
    assert answer.choices[0].text is not None


def test_priority_server_serves_the_same_answer_at_any_priority(tiny_model, tmp_path):
    with ServeProcess(tiny_model, "--served-model-name", "tiny-llm", "--scheduling-policy", "priority",
                      "--log-level", "WARNING", log_path=str(tmp_path / "serve.log")) as serve:
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        texts = {prio: client.completions.create(model="tiny-llm", prompt="the cat", max_tokens=6, temperature=0,
                                                 extra_body={"priority": prio}).choices[0].text
                 for prio in (-7, 0, 2**40)}
        assert len(set(texts.values())) == 1, texts
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny-llm", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_body={"priority": 2**64})
        assert caught.value.body["param"] == "priority"
