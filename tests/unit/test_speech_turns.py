"""The speech engine's turns (workers/speech/turns.py): threads computing one at a time, each under its
own random stream, passing the turn on between steps, with streamed requests before their first audio
going first. Plain threads and torch's global generator; every wait is bounded."""

from __future__ import annotations

import threading

import torch

from omnirelay.workers.speech.turns import RandomState, Turns

STEPS = 20


def draws(turns: Turns, seed: int, out: list, started: threading.Barrier | None = None) -> None:
    """``STEPS`` draws from the global generator, one per step, passing the turn on between them."""
    if started is not None:
        started.wait(10)
    with turns.hold(RandomState(seed, torch.device("cpu"))):
        for _ in range(STEPS):
            out.append(torch.randint(0, 1 << 30, (1,)).item())
            turns.pass_on()


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


def test_a_request_before_its_first_audio_goes_first_then_waits_in_line():
    turns, order = Turns(), []
    queued = threading.Event()

    def waiter(name: str, urgent: bool, ready: threading.Event) -> None:
        ready.set()
        with turns.hold(RandomState(0, torch.device("cpu")), urgent=urgent):
            order.append(name)
            if urgent:
                turns.spoke()
                turns.pass_on()   # spoke: now it waits in line behind the earlier one
                order.append(name + " again")

    holder_in = threading.Event()

    def holder() -> None:
        with turns.hold(RandomState(0, torch.device("cpu"))):
            holder_in.set()
            queued.wait(10)
            turns.pass_on()
            order.append("holder again")

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
    # Both are in line (each waits on the turn's condition): the holder passes the turn on.
    for _ in range(1000):
        with turns._cond:
            if len(turns._queue) == 2:
                break
        threading.Event().wait(0.005)
    queued.set()
    for thread in (first, normal, urgent):
        thread.join(30)
    assert order[:2] == ["urgent", "normal"]
    assert set(order[2:]) == {"holder again", "urgent again"}
