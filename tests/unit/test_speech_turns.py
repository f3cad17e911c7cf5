"""The speech engine's turns and slots (workers/speech/turns.py): threads computing one at a time (or
``capacity`` at a time), streamed requests first. Plain threads; every wait is bounded. (No random
stream is involved: each request draws from its own generator, tests/e2e/test_omni_speech.py's
parity with transformers checks the audio.)"""

from __future__ import annotations

import threading

from omnirelay.workers.speech.turns import Turns


def test_a_streamed_request_goes_first():
    turns, order = Turns(), []
    holder_in, queued = threading.Event(), threading.Event()

    def waiter(name: str, urgent: bool, ready: threading.Event) -> None:
        ready.set()
        with turns.hold(urgent=urgent):
            order.append(name)

    def holder() -> None:
        with turns.hold():
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
