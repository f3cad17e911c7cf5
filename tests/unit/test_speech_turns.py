"""The speech engine's turns (workers/speech/turns.py): threads computing one at a time, each under its
own random stream, giving the turn up while they wait, with streamed requests going first. Plain
threads and torch's global generator; every wait is bounded."""

from __future__ import annotations

import threading

import torch

from omnirelay.workers.speech.turns import RandomState, Turns

STEPS = 20


def draws(turns: Turns, seed: int, out: list, started: threading.Barrier | None = None) -> None:
    """``STEPS`` draws from the global generator, giving the turn up between them."""
    if started is not None:
        started.wait(10)
    with turns.hold(RandomState(seed, torch.device("cpu"))):
        for _ in range(STEPS):
            out.append(torch.randint(0, 1 << 30, (1,)).item())
            turns.outside(lambda: threading.Event().wait(0.001))


def test_interleaved_threads_draw_what_each_would_draw_alone():
    alone = {}
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        alone[seed] = [torch.randint(0, 1 << 30, (1,)).item() for _ in range(STEPS)]
    turns, got = Turns(), {seed: [] for seed in alone}
    started = threading.Barrier(3)
    threads = [threading.Thread(target=draws, args=(turns, seed, got[seed], started)) for seed in alone]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert got == alone


def test_a_generator_continues_into_the_global_stream_where_it_left_off():
    generator = torch.Generator().manual_seed(5)
    first = torch.randint(0, 1 << 30, (3,), generator=generator).tolist()
    torch.manual_seed(5)
    expected = torch.randint(0, 1 << 30, (3,)).tolist(), torch.randn(4)
    assert first == expected[0]
    with Turns().hold(RandomState.following(generator, 5, torch.device("cpu"))):
        assert torch.equal(torch.randn(4), expected[1])


def test_a_streamed_request_goes_first():
    turns, order = Turns(), []
    holder_in, queued = threading.Event(), threading.Event()

    def waiter(name: str, urgent: bool, ready: threading.Event) -> None:
        ready.set()
        with turns.hold(RandomState(0, torch.device("cpu")), urgent=urgent):
            order.append(name)

    def holder() -> None:
        with turns.hold(RandomState(0, torch.device("cpu"))):
            holder_in.set()
            queued.wait(10)

    first = threading.Thread(target=holder)
    first.start()
    assert holder_in.wait(10)
    normal_ready, urgent_ready = threading.Event(), threading.Event()
    normal = threading.Thread(target=waiter, args=("normal", False, normal_ready))
    normal.start()
    assert normal_ready.wait(10)
    urgent = threading.Thread(target=waiter, args=("urgent", True, urgent_ready))
    urgent.start()
    assert urgent_ready.wait(10)
    # Both are in line (each waits on the turn's condition) before the holder lets go.
    for _ in range(1000):
        with turns._cond:
            if len(turns._queue) == 2:
                break
        threading.Event().wait(0.005)
    queued.set()
    for thread in (first, normal, urgent):
        thread.join(30)
    assert order == ["urgent", "normal"]


def test_slots_hold_that_many_at_once_and_serve_urgent_waiters_first():
    from omnirelay.workers.speech.turns import Slots

    slots, order, inside, most = Slots(2), [], [0], [0]
    lock, release = threading.Lock(), threading.Event()

    def work(name: str, urgent: bool, ready: threading.Event) -> None:
        ready.set()
        with slots.hold(urgent=urgent):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                order.append(name)
            release.wait(10)
            with lock:
                inside[0] -= 1

    threads = []
    for name, urgent in (("a", False), ("b", False), ("c", False), ("d", True)):
        ready = threading.Event()
        threads.append(threading.Thread(target=work, args=(name, urgent, ready)))
        threads[-1].start()
        assert ready.wait(10)
        for _ in range(1000):   # in the slots or in line before the next one comes
            with slots._cond:
                if slots._inside + len(slots._queue) == len(threads):
                    break
            threading.Event().wait(0.005)
    release.set()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    assert most[0] == 2 and order[:2] == ["a", "b"] and order[2] == "d"
