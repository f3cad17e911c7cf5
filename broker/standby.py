"""A standby broker: ``omni-broker --endpoint B --standby-of A`` waits, unbound, while the broker at
A answers, and takes over (binds B and serves) once A has been silent for ``liveness_s``.

How the others follow: workers and gateways are given both endpoints (``--broker A,B``). Their
DEALER connects to both with ``ZMQ_IMMEDIATE``, so it sends only over a live connection: to A while
A is up (B is not bound, so never connected), to B once B binds. From there on it is the path of a
broker restart today: the new broker knows nobody, so it answers a worker's heartbeat or credit with
``Reregister`` and the worker registers again (its ``held`` requests the new broker does not know are
cancelled), and a gateway's next ``GatewayHello`` gets a ``HelloAck`` with another broker id, which
makes it resume its open streams on the new broker. Nothing is replicated between the two.

Watching A: a DEALER sends A a :class:`~omnirelay.broker.protocol.StatusQuery` every heartbeat
interval; any reply counts as alive. A standby that never heard from A takes over after
``liveness_s`` too (A failed before the standby started).

Limits, said plainly: one takeover, no way back (a restarted A must come back as a standby of B,
``--standby-of B``, or the two would be bound at once and a client connected to both would spread
its messages over two brokers); a partition that hides A from the standby but not from the workers
gives the same split. The standby's watch runs without CURVE (omni-broker refuses ``--standby-of``
with CURVE keys in this build).
"""

from __future__ import annotations

import logging
import time

import zmq

from . import protocol as p
from .config import BrokerConfig

log = logging.getLogger("omnirelay.broker")


def wait_for_takeover(active_endpoint: str, config: BrokerConfig, stop) -> bool:
    """Block while the broker at ``active_endpoint`` answers; True when it has been silent for
    ``config.liveness_s`` (take over), False when ``stop()`` became true first."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)   # a query to a dead broker is not queued for its return
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
    sock.connect(active_endpoint)
    last_heard = time.monotonic()
    query = 0
    try:
        while not stop():
            query += 1
            try:
                sock.send_multipart(p.encode(p.StatusQuery(query)), zmq.NOBLOCK)
            except zmq.Again:
                pass   # not connected: the active broker is down or not up yet
            deadline = time.monotonic() + config.heartbeat_interval_s
            while (left := deadline - time.monotonic()) > 0 and not stop():
                if sock.poll(int(min(left, 0.2) * 1000)):
                    sock.recv_multipart()
                    last_heard = time.monotonic()
            if time.monotonic() - last_heard > config.liveness_s:
                log.warning("active broker %s silent for %.1fs: taking over", active_endpoint,
                            time.monotonic() - last_heard)
                return True
        return False
    finally:
        sock.close(0)
        ctx.term()
