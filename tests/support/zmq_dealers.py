"""The client side of a test against a real broker (not a test module): DEALER sockets on one zmq
context, each connected to the broker's endpoint under an identity the test picks (a gateway's, a
worker's), never lingering, and all closed together with the context.
"""

from __future__ import annotations

import zmq


class Dealers:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket] = []

    def connect(self, identity: bytes) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.connect(self.endpoint)
        self.socks.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)
        self.ctx.term()
