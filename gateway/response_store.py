"""The gateway's store of Responses (``store: true``), for ``previous_response_id``, ``GET`` and
``DELETE /v1/responses/{id}``.

In memory, one per gateway process (a follow-up sent to another gateway behind the same load
balancer does not find its previous response: 404 naming ``previous_response_id``). Each entry
holds the response object as answered and the conversation that led to it, as chat messages
(history + the turn's input + the answer; never the ``instructions``, which OpenAI does not carry
over either).

Bounds (:class:`StoreLimits`), so the store cannot grow without limit:

* at most ``max_responses`` entries and ``max_bytes`` bytes (each entry weighed as its JSON);
  beyond either, the least recently used entries (stored, read or continued) are evicted first;
* an entry lives ``ttl_s`` seconds from when it was stored; an expired one is gone as if evicted;
* an entry heavier than ``max_bytes`` on its own is not stored (its id then answers 404).

Not thread-safe: the gateway's event loop is its only user.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from typing import Callable


@dataclasses.dataclass(frozen=True)
class StoreLimits:
    max_responses: int = 1024
    max_bytes: int = 64 * 1024 * 1024
    ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_responses < 1 or self.max_bytes < 1 or self.ttl_s <= 0:
            raise ValueError("response store limits must be positive")


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    response: dict          # the response object as answered
    messages: list[dict]    # chat messages of the whole conversation, the answer included
    nbytes: int
    expires: float


class ResponseStore:
    """See the module docstring. ``clock``: monotonic seconds (a test may pass its own)."""

    def __init__(self, limits: StoreLimits = StoreLimits(), clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self._clock = clock
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, response: dict, messages: list[dict]) -> bool:
        """Store ``response`` under its ``id``; False when it alone exceeds ``max_bytes``."""
        nbytes = len(json.dumps(response)) + len(json.dumps(messages))
        if nbytes > self.limits.max_bytes:
            return False
        self._drop(response["id"])
        self._expire()
        while self._entries and (len(self._entries) >= self.limits.max_responses
                                 or self._bytes + nbytes > self.limits.max_bytes):
            self._drop(next(iter(self._entries)))
            self.evicted += 1
        self._entries[response["id"]] = StoredResponse(response, messages, nbytes,
                                                       self._clock() + self.limits.ttl_s)
        self._bytes += nbytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The live entry (now the most recently used), or None."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if entry.expires <= self._clock():
            self._drop(response_id)
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self.get(response_id) is not None and self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.nbytes
        return entry is not None

    def _expire(self) -> None:
        now = self._clock()
        for response_id in [k for k, e in self._entries.items() if e.expires <= now]:
            self._drop(response_id)
