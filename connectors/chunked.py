"""Chunked transfer over any connector: a producer streams a sequence of payloads (the KV cache
layer by layer, audio codes chunk by chunk) and the consumer starts on the first chunk before the
last one is written.

Keys, for a stream under ``K``::

    K/chunk/0, K/chunk/1, …     the chunks, each an ordinary payload
    K/chunk/<n>                 the end marker: {"omnirelay.end": n} or, if the producer
                                gave up, {"omnirelay.end": n, "omnirelay.error": message}

The end marker sits at the next index, so the consumer only ever waits for one key at a time: it
gets ``K/chunk/i`` and either receives chunk ``i`` or learns the stream ended. Nothing else is
needed to coordinate, so this works over every backend, including key-only retrieval.

Producer (from the stage's engine thread)::

    with ChunkedProducer(connector, key) as stream:     # the end marker is written on exit;
        for layer in range(num_layers):                 # an exception writes an error marker
            stream.put({"k": k[layer], "v": v[layer]})

Consumer::

    for chunk in ChunkedConsumer(connector, key, timeout=30):   # raises TransferFailed on an
        cache.write_layer(chunk)                                # error marker or a timeout

The consumer deletes every chunk once it has been handed out (the next chunk is fetched only when
the caller asks for it) and the end marker at the end; the connector's TTL covers streams whose
consumer never came. Both sides are small state machines (:class:`StreamState`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

from omnirelay.errors import TransferFailed

from .base import DEFAULT_GET_TIMEOUT_S, Connector, Handle, Payload

END = "omnirelay.end"
ERROR = "omnirelay.error"


def chunk_key(key: str, index: int) -> str:
    return f"{key}/chunk/{index}"


class StreamState(enum.Enum):
    OPEN = "open"            # producer: chunks may follow / consumer: waiting for the next one
    FINISHED = "finished"    # the end marker was written / read
    ABORTED = "aborted"      # the producer gave up, or the consumer hit an error


class ChunkedProducer:
    """Writes the chunks of one stream in order; not thread-safe (one producer per stream)."""

    def __init__(self, connector: Connector, key: str):
        self.connector = connector
        self.key = key
        self.count = 0
        self.state = StreamState.OPEN
        self.handles: list[Handle] = []

    def put(self, payload: Payload) -> Handle:
        """Publish the next chunk; it is readable by the consumer when this returns."""
        if self.state is not StreamState.OPEN:
            raise TransferFailed(f"stream {self.key!r} is {self.state.value}")
        if END in payload:
            raise ValueError(f"{END!r} is reserved for the end marker of a stream")
        handle = self.connector.put(chunk_key(self.key, self.count), payload)
        self.count += 1
        self.handles.append(handle)
        return handle

    def finish(self) -> None:
        """Write the end marker. Idempotent."""
        if self.state is StreamState.OPEN:
            self.connector.put(chunk_key(self.key, self.count), {END: self.count})
            self.state = StreamState.FINISHED

    def abort(self, message: str) -> None:
        """Tell the consumer the stream will not complete. Idempotent."""
        if self.state is StreamState.OPEN:
            self.state = StreamState.ABORTED
            self.connector.put(chunk_key(self.key, self.count), {END: self.count, ERROR: message})

    def __enter__(self) -> "ChunkedProducer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.finish()
        else:
            self.abort(f"{type(exc).__name__}: {exc}")


class ChunkedConsumer:
    """Iterates over the chunks of one stream as they arrive.

    ``timeout`` bounds the wait for each chunk (a producer that stalls longer fails the stream);
    ``delete`` removes each chunk after it was handed out.
    """

    def __init__(self, connector: Connector, key: str, *, timeout: float = DEFAULT_GET_TIMEOUT_S,
                 delete: bool = True):
        self.connector = connector
        self.key = key
        self.timeout = timeout
        self.delete = delete
        self.received = 0
        self.state = StreamState.OPEN

    def __iter__(self) -> Iterator[Payload]:
        while self.state is StreamState.OPEN:
            key = chunk_key(self.key, self.received)
            try:
                payload = self.connector.get(key, timeout=self.timeout)
            except TransferFailed as exc:
                self.state = StreamState.ABORTED
                raise TransferFailed(f"stream {self.key!r}: chunk {self.received} not received: {exc}") from None
            if set(payload) <= {END, ERROR} and isinstance(payload.get(END), int):
                if self.delete:
                    self.connector.delete(key)
                if ERROR in payload:
                    self.state = StreamState.ABORTED
                    raise TransferFailed(f"stream {self.key!r} aborted by its producer after "
                                         f"{payload[END]} chunks: {payload[ERROR]}")
                self.state = StreamState.FINISHED
                return
            self.received += 1
            try:
                yield payload
            finally:   # also when the caller stops early
                if self.delete:
                    self.connector.delete(key)


def read_all(connector: Connector, key: str, *, timeout: float = DEFAULT_GET_TIMEOUT_S) -> list[Payload]:
    """Every chunk of a stream, in order (for callers that do not need to overlap)."""
    return list(ChunkedConsumer(connector, key, timeout=timeout))


def discard(connector: Connector, key: str, *, upto: int = 1 << 16, timeout: float = 0.0) -> int:
    """Delete what is left of a stream (a cancelled request): chunks from 0 until the first
    missing one, end marker included. Returns how many keys were deleted."""
    deleted = 0
    for index in range(upto):
        try:
            payload = connector.get(chunk_key(key, index), timeout=timeout)
        except TransferFailed:
            break
        connector.delete(chunk_key(key, index))
        deleted += 1
        if END in payload:
            break
    return deleted


__all__ = ["ChunkedConsumer", "ChunkedProducer", "StreamState", "chunk_key", "discard", "read_all"]
