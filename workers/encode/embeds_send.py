"""The encode stage's hand-off as a transfer job: one step's embeddings go to the connector while the
next batch encodes.

:class:`EmbedsSend` puts each request's payload under its own key (``mm/<request_id>/<attempt>``)
and returns, per request, the handle or the error that put raised: one request's failed put fails
that request only. On shared memory the pool runs it inline (a write that cannot wait, see
``Connector.local_writes``); on a store across the network it runs on a transfer thread.

Ownership (the pool's rule): until the engine takes the result, the job owns every key it put, and
``discard`` deletes them (the request was cancelled, or the worker is stopping: a retry encodes
again under a new attempt, with a new key).
"""

from __future__ import annotations

import dataclasses

from omnirelay.connectors import Connector
from omnirelay.connectors.base import Handle, Payload
from omnirelay.errors import OmniError
from omnirelay.handoffs import delete_quietly


@dataclasses.dataclass
class OutgoingEmbeds:
    """One request's embeddings to put; ``grids`` and ``lengths`` travel in its EmbedsHandoff."""

    request_id: str
    key: str
    payload: Payload | None
    grids: list[list[int]]
    lengths: list[int]


class EmbedsSend:
    writes_only = True   # puts only: inline on a local connector

    def __init__(self, outgoing: list[OutgoingEmbeds], deadline: float):
        self.outgoing = outgoing
        self.deadline = deadline
        self._put: list[str] = []   # keys published so far, for discard

    @property
    def name(self) -> str:
        return ", ".join(item.key for item in self.outgoing)

    def run(self, connector: Connector, timeout: float, scratch: None) -> dict[str, Handle | OmniError]:
        sent: dict[str, Handle | OmniError] = {}
        for item in self.outgoing:
            payload, item.payload = item.payload, None   # the embeddings' memory goes with the put
            try:
                sent[item.request_id] = connector.put(item.key, payload)
            except OmniError as exc:
                sent[item.request_id] = exc
                continue
            self._put.append(item.key)
        return sent

    def discard(self, connector: Connector, result: dict[str, Handle | OmniError] | None) -> None:
        for key in self._put:
            delete_quietly(connector, key)
