"""Decode's side of a streamed spoken reply: the thinker's states go to the generate stage in chunks
while the reply is still being written, so the talker starts on the first chunk.

Life of a streamed reply (a speech request on a decode worker with ``stream_chunk_tokens`` K > 0)::

    running ──every K new tokens, one chunk at a time──▶ ReplyChunkSend on the transfer pool
        (chunk i under ChunkStream.chunk(i): the new token ids and the states of the new fed tokens)
        ──chunk 0 written──▶ announced: the engine reports a StageStreaming hand-off
          (SpeechHandoff.reply_stream), the broker dispatches generate now
    finished (EOS / stop / max_tokens) ──▶ blocks freed, the writer waits in ``finishing`` ──▶
        the last chunk (``end``) written ──▶ the last token is reported, with the StageDone
        (outputs None once announced; the whole stream as the hand-off when the reply fit one chunk)
    a chunk whose put failed ──▶ the request fails with the put's error; every chunk key released
    cancel ──▶ the chunk in flight discarded, every chunk key and the prompt's states released
    the consumer finished first (a talker stops at its codec budget or EOS before the thinker does;
        the broker's CancelTask.streams_only) ──▶ closed: nothing more is written, the chunks that
        may exist are deleted, the reply goes on and its last token leaves without waiting

Back-pressure: the consumer deletes each chunk once read. Chunk i is written only once chunk
``i - window`` is gone (``ReplyChunkSend`` looks first and reports ``False`` without writing); until
then the states wait in this worker's memory, where the sequential hand-off would keep them anyway.
One chunk is in flight per request, so chunks are written in order; a slow put makes the next chunk
larger, never more numerous.
"""

from __future__ import annotations

import dataclasses
import math

import msgspec
import torch

from omnirelay.connectors import Connector
from omnirelay.errors import OmniError
from omnirelay.handoffs import ChunkStream, SpeechHandoff, delete_quietly, speech_reply_key

from omnirelay.workers.runtime.transfers import Transfer

# Chunks written and not yet read, at most: a talker running behind holds the thinker's states
# back in the decode worker instead of in the store.
STREAM_WINDOW = 8


@dataclasses.dataclass
class ReplyChunkSend:
    """Put chunk ``index`` of ``stream``, unless the consumer is ``window`` chunks behind; the result
    says whether it was written (False: try again later, nothing written)."""

    stream: ChunkStream
    index: int
    payload: dict
    deadline: float

    @property
    def writes_only(self) -> bool:   # a chunk past the window looks at an earlier one first
        return self.index < self.stream.window

    @property
    def name(self) -> str:
        return self.stream.chunk(self.index)

    def run(self, connector: Connector, timeout: float, scratch: None) -> bool:
        if self.index >= self.stream.window:
            try:
                connector.get(self.stream.chunk(self.index - self.stream.window), timeout=0.0)
            except OmniError:
                pass   # read and deleted by the consumer: room for one more
            else:
                return False
        connector.put(self.name, self.payload)
        return True

    def discard(self, connector: Connector, result: bool | None) -> None:
        if result:
            delete_quietly(connector, self.name)


@dataclasses.dataclass
class ReplyStreamWriter:
    """One streamed reply's progress: what was written, what is on its way, whether the broker was
    told (``announced``)."""

    stream: ChunkStream
    prompt: SpeechHandoff
    chunk_tokens: int
    sent_tokens: int = 0                  # reply token ids written so far
    sent_states: int = 0                  # … and states
    next_index: int = 0
    in_flight: ReplyChunkSend | None = None
    ticket: Transfer[bool] | None = None
    announced: bool = False
    ended: bool = False                   # the last chunk is written
    closed: bool = False                  # the consumer finished first: nothing more is written

    @classmethod
    def open(cls, prompt: SpeechHandoff, max_tokens: int, chunk_tokens: int, request_id: str) -> "ReplyStreamWriter":
        key = speech_reply_key(prompt.speech_prompt_key, request_id)
        # One chunk per K tokens, and the last one may hold none: a bound both sides can count on.
        stream = ChunkStream(key, max_chunks=math.ceil(max_tokens / chunk_tokens) + 2, window=STREAM_WINDOW)
        return cls(stream, prompt, chunk_tokens)

    @property
    def handoff(self) -> SpeechHandoff:
        """What the generate stage reads: prefill's prompt states and this stream."""
        return msgspec.structs.replace(self.prompt, reply_stream=self.stream)

    def next_chunk(self, generated: list[int], states: list[torch.Tensor], final: bool,
                   deadline: float) -> ReplyChunkSend | None:
        """The next chunk to write, when one is due and none is on its way: K new tokens, or what is
        left once the reply is ``final``."""
        if self.in_flight is not None or self.ended or self.closed:
            return None
        if not final and len(generated) - self.sent_tokens < self.chunk_tokens:
            return None
        rows = states[self.sent_states:]
        payload = {"token_ids": list(generated[self.sent_tokens:]),
                   "hidden": torch.stack(rows) if rows else torch.zeros(0, 0), "end": final}
        self.in_flight = ReplyChunkSend(self.stream, self.next_index, payload, deadline)
        return self.in_flight

    def written(self) -> None:
        """The chunk in flight is in the store."""
        chunk = self.in_flight
        self.sent_tokens += len(chunk.payload["token_ids"])
        self.sent_states += chunk.payload["hidden"].shape[0]
        self.next_index += 1
        self.ended = bool(chunk.payload["end"])
        self.in_flight = self.ticket = None

    def deferred(self) -> None:
        """The consumer is a window behind: the same chunk (grown by then) is tried again later."""
        self.in_flight = self.ticket = None

    def release(self, connector: Connector) -> None:
        """A cancelled or failed reply: every chunk it may have written, and the prompt's states."""
        self.release_chunks(connector)
        self.prompt.release(connector)

    def release_chunks(self, connector: Connector) -> None:
        """The chunks that may still exist: never more than the last ``window`` written (chunk i was
        written only once chunk i - window was gone)."""
        self.stream.release(connector, first=max(0, self.next_index - self.stream.window))
