"""The engines' shared waiting line: FIFO order, cancel by request id, expiry by deadline, batch
admission by key, and the front insert of a preempted task."""

from __future__ import annotations

import dataclasses

import pytest

from omnirelay.workers.runtime.request_queue import RequestQueue


@dataclasses.dataclass
class Task:
    request_id: str
    deadline: float = 1000.0
    shape: str = "a"


def ids(queue: RequestQueue) -> list[str]:
    return [t.request_id for t in queue]


def queue_of(*tasks: Task) -> RequestQueue[Task]:
    queue: RequestQueue[Task] = RequestQueue()
    for task in tasks:
        queue.add(task)
    return queue


def test_fifo_order_len_bool_and_head():
    queue = queue_of()
    assert not queue and len(queue) == 0 and queue.head is None
    with pytest.raises(IndexError):
        queue.popleft()
    queue = queue_of(Task("r1"), Task("r2"), Task("r3"))
    assert queue and len(queue) == 3
    assert queue.head.request_id == "r1" and len(queue) == 3   # head does not take
    assert [queue.popleft().request_id for _ in range(3)] == ["r1", "r2", "r3"]
    assert not queue


def test_remove_takes_the_request_out_and_keeps_the_rest_in_order():
    queue = queue_of(Task("r1"), Task("r2"), Task("r3"))
    taken = queue.remove("r2")
    assert taken is not None and taken.request_id == "r2"
    assert ids(queue) == ["r1", "r3"]
    assert queue.remove("r2") is None and queue.remove("unknown") is None
    assert ids(queue) == ["r1", "r3"]


def test_remove_all_takes_every_task_of_a_request():
    queue = queue_of(Task("img"), Task("other"), Task("img"), Task("img"))
    assert len(queue.remove_all("img")) == 3
    assert ids(queue) == ["other"]
    assert queue.remove_all("img") == []


def test_remove_task_is_by_identity_not_equality():
    twin_a, twin_b = Task("r1"), Task("r1")     # equal dataclasses, different tasks
    queue = queue_of(twin_a, twin_b)
    queue.remove_task(twin_b)
    assert len(queue) == 1 and queue.head is twin_a
    with pytest.raises(ValueError):
        queue.remove_task(twin_b)


def test_pop_expired_takes_out_only_past_deadlines_in_order():
    queue = queue_of(Task("late1", deadline=5.0), Task("live1", deadline=20.0), Task("late2", deadline=9.0),
                     Task("edge", deadline=10.0), Task("live2", deadline=30.0))
    expired = queue.pop_expired(now=10.0)
    assert [t.request_id for t in expired] == ["late1", "late2"]   # a deadline equal to now is still live
    assert ids(queue) == ["live1", "edge", "live2"]
    assert queue.pop_expired(now=10.0) == []
    assert [t.request_id for t in queue.pop_expired(now=25.0)] == ["live1", "edge"]
    assert ids(queue) == ["live2"]


def test_pop_expired_defaults_to_the_wall_clock():
    queue = queue_of(Task("past", deadline=1.0), Task("future", deadline=4e9))   # 1970 and 2096
    assert [t.request_id for t in queue.pop_expired()] == ["past"]
    assert ids(queue) == ["future"]


def test_appendleft_puts_a_preempted_task_first():
    queue = queue_of(Task("r2"), Task("r3"))
    queue.appendleft(Task("r1"))
    assert ids(queue) == ["r1", "r2", "r3"]


def test_take_batch_takes_the_head_and_its_kind_up_to_the_limit():
    queue = queue_of(Task("a1", shape="a"), Task("b1", shape="b"), Task("a2", shape="a"), Task("a3", shape="a"),
                     Task("b2", shape="b"), Task("a4", shape="a"))
    batch = queue.take_batch(3, key=lambda t: t.shape)
    assert [t.request_id for t in batch] == ["a1", "a2", "a3"]
    assert ids(queue) == ["b1", "b2", "a4"]            # the rest keep their order
    assert [t.request_id for t in queue.take_batch(3, key=lambda t: t.shape)] == ["b1", "b2"]
    assert [t.request_id for t in queue.take_batch(1, key=lambda t: t.shape)] == ["a4"]
    assert queue.take_batch(3, key=lambda t: t.shape) == []


def test_take_batch_does_not_ask_the_key_of_tasks_after_a_full_batch():
    queue = queue_of(Task("a1"), Task("a2"), Task("later"))
    asked = []

    def key(task):
        asked.append(task.request_id)
        return task.shape

    assert [t.request_id for t in queue.take_batch(2, key)] == ["a1", "a2"]
    assert asked == ["a1", "a2"] and ids(queue) == ["later"]


def test_clear_empties():
    queue = queue_of(Task("r1"), Task("r2"))
    queue.clear()
    assert not queue and ids(queue) == []
