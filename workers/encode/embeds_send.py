"""The encode stage's hand-off as a transfer job: a request's embeddings go to the connector while
the next batch encodes.

:class:`EmbedsSend` puts one request's payload under its key (``mm/<request_id>/<attempt>``); a
failed put fails that request only. On shared memory the pool runs it inline (a write that cannot
wait, see ``Connector.local_writes``); on a store across the network it runs on a transfer thread.

Ownership (the pool's rule): until the engine takes the handle, the job owns the key, and
``discard`` deletes it (the request was cancelled, or the worker is stopping: a retry encodes
again under a new attempt, with a new key).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from omnirelay.connectors import Connector
from omnirelay.connectors.base import Handle, Payload
from omnirelay.handoffs import delete_quietly


@dataclasses.dataclass
class EmbedsSend:
    """One request's embeddings; ``grids`` and ``lengths`` travel in its EmbedsHandoff."""

    request_id: str
    name: str                  # its connector key
    payload: Payload | None
    grids: list[list[int]]
    lengths: list[int]
    deadline: float
    writes_only: ClassVar[bool] = True   # a put: inline on a local connector

    def run(self, connector: Connector, timeout: float, scratch: None) -> Handle:
        payload, self.payload = self.payload, None   # the embeddings' memory goes with the put
        return connector.put(self.name, payload)

    def discard(self, connector: Connector, result: Handle | None) -> None:
        delete_quietly(connector, self.name)
