"""Turns: what the synthesis threads of one speech worker may not do at the same time, done one at
a time, each under its own random stream.

The talker's decode steps are not among them: those run batched (step_batch.py) and sample from
per-request generators. What still takes turns: a talker's prompt forward (the talker module keeps
the M-RoPE ``rope_deltas`` it computes there, one value for the module) and whatever draws from
torch's global random stream (Qwen2.5-Omni's one-shot token2wav noise, Qwen3-TTS's whole
``generate``). A thread holding the turn runs with the global stream set to its request's own
state (saved again when it lets go), so a request's draws are exactly those it would make alone
after ``torch.manual_seed(seed)``.

A thread takes the turn (:meth:`Turns.hold`) and gives it up while it blocks (:meth:`Turns.outside`:
waiting for its thinker's first chunk, say); waiting threads are served in arrival order, except
that a streamed request (``hold(..., urgent=True)``) goes before the others: time to first audio is
what a listener waits for (the way a scheduler runs a new prompt's prefill first).

:class:`Slots` is the same line with room for more than one and no random stream: for work that
draws none and only competes for the cores (the vocoders: engine.py ``VOCODER_SLOTS``).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Callable, Iterator

import torch


class RandomState:
    """One request's random stream: torch's global CPU (and current CUDA device's) generator state."""

    def __init__(self, seed: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.index = device.index if device.index is not None else (torch.cuda.current_device() if self.cuda else 0)
        cpu = torch.Generator().manual_seed(seed)
        self.cpu = cpu.get_state()
        self.gpu = None
        if self.cuda:
            gen = torch.Generator(device=f"cuda:{self.index}").manual_seed(seed)
            self.gpu = gen.get_state()

    @classmethod
    def following(cls, generator: torch.Generator, seed: int, device: torch.device) -> "RandomState":
        """The stream ``seed`` gave, where ``generator`` (seeded with it, on ``device``) left off:
        what transformers draws next from the global stream after a talker's draws."""
        state = cls(seed, device)
        if generator.device.type == "cuda":
            state.gpu = generator.get_state()
        else:
            state.cpu = generator.get_state()
        return state

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.gpu is not None:
            torch.cuda.set_rng_state(self.gpu, self.index)

    def save(self) -> None:
        self.cpu = torch.get_rng_state()
        if self.gpu is not None:
            self.gpu = torch.cuda.get_rng_state(self.index)


class Turns:
    """The one turn of a worker's synthesis threads (FIFO)."""

    def __init__(self, stateful: tuple[torch.nn.Module, ...] = ()):
        """``stateful``: modules that keep per-generation state between steps in ``rope_deltas``
        (transformers' M-RoPE talkers): each thread's value is put back when it takes the turn."""
        self._stateful = stateful
        self._cond = threading.Condition()
        self._holder: _Waiter | None = None
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._local = threading.local()

    def _save_modules(self) -> None:
        self._local.modules = [m.rope_deltas for m in self._stateful]

    def _restore_modules(self) -> None:
        for module, value in zip(self._stateful, getattr(self._local, "modules", None) or [None] * len(self._stateful)):
            module.rope_deltas = value

    def _next_locked(self) -> _Waiter | None:
        """Who takes the turn next: the first urgent waiter, else the first waiter."""
        return next((w for w in self._queue if w.urgent), self._queue[0] if self._queue else None)

    def _acquire(self) -> None:
        me = _Waiter(bool(getattr(self._local, "urgent", False)))
        with self._cond:
            self._queue.append(me)
            while self._holder is not None or self._next_locked() is not me:
                self._cond.wait()
            self._queue.remove(me)
            self._holder = me

    def _release(self) -> None:
        with self._cond:
            self._holder = None
            self._cond.notify_all()

    @contextlib.contextmanager
    def hold(self, rng: RandomState, urgent: bool = False) -> Iterator[None]:
        """Run the block holding the turn, under ``rng``'s stream; ``urgent``: first in line."""
        self._local.urgent = urgent
        self._acquire()
        self._local.rng = rng
        self._local.modules = None   # a new generation starts from no state
        rng.restore()
        self._restore_modules()
        try:
            yield
        finally:
            rng.save()
            self._local.rng = None
            self._local.urgent = False
            self._release()

    def outside(self, wait: Callable[[], None]) -> None:
        """Run ``wait`` (a blocking read) with the turn given up; take it back after. Outside a
        :meth:`hold` block it just runs ``wait``."""
        rng = getattr(self._local, "rng", None)
        if rng is None:
            wait()
            return
        rng.save()
        self._save_modules()
        self._release()
        try:
            wait()
        finally:
            self._acquire()
            rng.restore()
            self._restore_modules()


class Slots:
    """At most ``capacity`` threads inside at once; waiters are served in arrival order, urgent ones
    first. No random stream is set: for work that draws none (the streamed vocoders)."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._cond = threading.Condition()
        self._inside = 0
        self._queue: collections.deque[_Waiter] = collections.deque()

    @contextlib.contextmanager
    def hold(self, urgent: bool = False) -> Iterator[None]:
        me = _Waiter(urgent)
        with self._cond:
            self._queue.append(me)
            while self._inside >= self.capacity or \
                    next((w for w in self._queue if w.urgent), self._queue[0]) is not me:
                self._cond.wait()
            self._queue.remove(me)
            self._inside += 1
            self._cond.notify_all()   # the next in line may fit too
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                self._cond.notify_all()


class _Waiter:
    __slots__ = ("urgent",)

    def __init__(self, urgent: bool):
        self.urgent = urgent
