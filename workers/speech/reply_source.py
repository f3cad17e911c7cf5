"""The thinker's reply as the talker reads it: whole (the sequential hand-off) or arriving in chunks
while decode still writes it (a streamed hand-off, ``omnirelay.handoffs.ChunkStream``).

The talker reads one reply row per codec step. :meth:`ReplySource.wait_tokens` blocks the calling
synthesis thread (never the worker's loop) until the reply has at least that many tokens or is
known to have ended: for a streamed reply it reads the next chunks from the connector, in order,
deleting each once read (which is what lets decode write more: its window). While it waits, the
thread is away from the step batch (``waiting``, set by the engine) so other requests' talkers run.

A reply's token ids are ``t0 … t(m-1)``; ``hidden`` holds the thinker's state of each token fed
back into it, ``t0 … t(m-2)`` (the last token is never fed). Both grow together in a stream: a
chunk carries the next token ids and the states of the tokens fed since the previous one.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from omnirelay.connectors import Connector
from omnirelay.errors import BadRequest, DeadlineExceeded, TransferFailed
from omnirelay.handoffs import ChunkStream, delete_quietly

from omnirelay.workers.speech.stream import SynthesisCancelled


class ReplySource:
    """A reply's token ids and states, complete or streamed."""

    # A wait for a chunk is cut into slices this long so a cancel is noticed within one.
    WAIT_SLICE_S = 0.25

    def __init__(self, token_ids: list[int], hidden: torch.Tensor | None, *, stream: ChunkStream | None = None,
                 connector: Connector | None = None, timeout_s: float = 30.0, deadline: float = float("inf")):
        self.token_ids = list(token_ids)
        self._rows: list[torch.Tensor] = [] if hidden is None else list(hidden.unbind(0))
        self.stream, self.connector = stream, connector
        self.ended = stream is None
        self.timeout_s, self.deadline = timeout_s, deadline
        self.cancelled = threading.Event()
        self.chunks_read = 0
        # Called around a blocking read: the talker's seat is away from the step batch while it waits.
        self.waiting: Callable[[Callable[[], None]], None] = lambda wait: wait()

    @classmethod
    def streamed(cls, stream: ChunkStream, connector: Connector, *, timeout_s: float, deadline: float) -> "ReplySource":
        return cls([], None, stream=stream, connector=connector, timeout_s=timeout_s, deadline=deadline)

    @property
    def num_states(self) -> int:
        return len(self._rows)

    def state(self, index: int) -> torch.Tensor:
        return self._rows[index]

    def states(self) -> torch.Tensor:
        return torch.stack(self._rows)

    def wait_tokens(self, count: int) -> bool:
        """Read on until the reply has ``count`` tokens (True) or ended shorter (False)."""
        while len(self.token_ids) < count and not self.ended:
            self.waiting(self._read_next)
        return len(self.token_ids) >= count

    def wait_states(self, count: int) -> bool:
        """Read on until ``count`` states exist (True) or the reply ended with fewer (False)."""
        while len(self._rows) < count and not self.ended:
            self.waiting(self._read_next)
        return len(self._rows) >= count

    def wait_end(self) -> None:
        while not self.ended:
            self.waiting(self._read_next)

    def _read_next(self) -> None:
        key = self.stream.chunk(self.chunks_read)
        if self.chunks_read >= self.stream.max_chunks:
            raise BadRequest(f"streamed reply {self.stream.key!r} has no end within {self.stream.max_chunks} chunks")
        give_up = min(time.time() + self.timeout_s, self.deadline)
        while True:
            if self.cancelled.is_set():
                raise SynthesisCancelled()
            left = give_up - time.time()
            if left <= 0:
                if time.time() >= self.deadline:
                    raise DeadlineExceeded("request deadline passed while waiting for the thinker's reply")
                raise TransferFailed(f"streamed reply chunk {key!r} not available within {self.timeout_s:g}s")
            try:
                payload = self.connector.get(key, timeout=min(self.WAIT_SLICE_S, left))
                break
            except TransferFailed:
                continue
        tokens, hidden, end = payload.get("token_ids"), payload.get("hidden"), payload.get("end")
        if not isinstance(tokens, list) or not isinstance(hidden, torch.Tensor) or not isinstance(end, bool):
            raise BadRequest(f"streamed reply chunk {key!r} is malformed")
        self.token_ids += [int(t) for t in tokens]
        if hidden.numel():
            self._rows += list(hidden.clone().unbind(0))   # a connector view pins its memory: copy
        self.chunks_read += 1
        self.ended = end
        delete_quietly(self.connector, key)   # read: decode may write one more (its window)
        if len(self._rows) > max(0, len(self.token_ids) - 1):
            raise BadRequest(f"streamed reply chunk {key!r} has more states than fed tokens")
