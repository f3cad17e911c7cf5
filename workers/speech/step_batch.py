"""StepBatch: the talker steps of every request a speech worker holds, run as one batched forward.

Each request keeps its own synthesis thread (engine.py): it builds its talker prompt, waits for its
thinker's chunks, runs its vocoder. What they share is the talker's decode step, the part that
grows with concurrency: a thread :meth:`StepBatch.ride`\\ s each of its steps, and the steps of all
threads that are ready run together as one forward (``run``, the engine's batched step).

When a batch runs: once every *present* thread has asked for its step. A thread is present from
:meth:`seat` until it leaves that block, except while it is :meth:`away` — waiting for the
thinker's next chunk, or running its vocoder — so one slow request never holds back the others'
steps, and a step never waits for a thread that is not coming. The thread whose request completes
the batch runs it (no scheduler thread); the others wait for their result.

What a batch may not change: a request's result. Each request samples from its own generator
(talker_batch.py), so which neighbours shared its forward moves its logits only by float rounding
(batched matmuls sum in another order), never its random draws.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator


class Seat:
    """One request's place in the batch: the step it asked for, then that step's result."""

    __slots__ = ("state", "done", "error")

    def __init__(self, state):
        self.state = state          # what ``run`` reads and advances (a family's row: qwen3_talker.Qwen3Row, …)
        self.done = False
        self.error: BaseException | None = None


class StepBatch:
    """The rendezvous of the synthesis threads' talker steps (see the module docstring)."""

    def __init__(self, run: Callable[[list[Seat]], None], idle: Callable[[], None] = lambda: None):
        """``run(seats)``: one batched step of these seats' requests (raises: every seat fails);
        ``idle()``: called when the last seat is left and no step runs (drops what the batch held:
        no request that rode in it is still talking)."""
        self._run, self._idle = run, idle
        self._cond = threading.Condition()
        self._present = 0           # seats not away: a batch runs once all of them asked
        self._seated = 0
        self._asked: list[Seat] = []
        self._running = False
        self.batches = 0            # steps run, and the requests they carried: the mean batch size
        self.rows = 0
        self.largest = 0

    @contextlib.contextmanager
    def seat(self, state) -> Iterator[Seat]:
        """Hold a seat for one request's talker loop (present until the block ends)."""
        seat = Seat(state)
        with self._cond:
            self._present += 1
            self._seated += 1
        try:
            yield seat
        finally:
            with self._cond:
                self._present -= 1
                self._seated -= 1
                if not self._seated and not self._running:
                    self._idle()
                self._cond.notify_all()   # the others may now be all that a batch waits for

    def away(self, wait: Callable[[], object]):
        """Run ``wait`` (a blocking read, a vocoder piece) without holding back the others' steps."""
        with self._cond:
            self._present -= 1
            self._cond.notify_all()
        try:
            return wait()
        finally:
            with self._cond:
                self._present += 1

    def ride(self, seat: Seat) -> None:
        """Run the seat's next step (in a batch with whoever else is ready); re-raises a batch failure."""
        with self._cond:
            seat.done, seat.error = False, None
            self._asked.append(seat)
            self._cond.notify_all()
            while not seat.done:
                if not self._running and self._asked and len(self._asked) >= self._present:
                    self._lead()
                else:
                    self._cond.wait()
        if seat.error is not None:
            raise seat.error

    def _lead(self) -> None:
        """Run the batch of every seat that asked (called holding the lock; computes without it)."""
        seats, self._asked, self._running = self._asked, [], True
        self._cond.release()
        error: BaseException | None = None
        try:
            self._run(seats)
        except BaseException as exc:   # a failed forward fails every request in it, not the worker
            error = exc
        finally:
            self._cond.acquire()
        self._running = False
        self.batches += 1
        self.rows += len(seats)
        self.largest = max(self.largest, len(seats))
        for seat in seats:
            seat.done, seat.error = True, error
        self._cond.notify_all()
