"""A standby broker: ``omni-broker --endpoint B --standby-of A`` waits, unbound, while the broker at
A answers, and takes over (binds B and serves) once A has been silent for ``liveness_s``.

How the others follow: workers and gateways are given both endpoints (``--broker A,B``). Their
DEALER connects to both with ``ZMQ_IMMEDIATE``, so it sends only over a live connection: to A while
A is up (B is not bound, so never connected), to B once B binds. From there on it is the path of a
broker restart today: the new broker knows nobody, so it answers a worker's heartbeat or credit with
``Reregister`` and the worker registers again (its ``held`` requests the new broker does not know are
cancelled), and a gateway's next ``GatewayHello`` gets a ``HelloAck`` with another broker id, which
makes it resume its open streams on the new broker. Nothing is replicated between the two. One
difference from a restart: the new broker holds the gateways' messages back for two heartbeat
intervals (``BrokerDaemon(warm_up_s=…)``), so that the streams resumed in its first moments find the
workers registered instead of failing as ``unavailable``.

Repeated failover: the pair is symmetric. Each broker names the other (``--endpoint A --standby-of
B`` and ``--endpoint B --standby-of A``), and whichever dies is restarted with its same command line
(a supervisor's ``Restart=always``): it finds the survivor answering and waits as its standby, ready
for the next kill. The clients need nothing new: their DEALER keeps reconnecting to the dead
endpoint (at most every second), so when the restarted broker binds there after the next take-over
they reach it the way they reached B the first time. Every take-over is a fresh broker, so the
gateway sees a new broker id each time and resumes its streams again.

Watching A: a DEALER sends A a :class:`~omnirelay.broker.protocol.StatusQuery` every heartbeat
interval; any reply counts as alive. A standby that never heard from A takes over after
``liveness_s`` too (A failed before the standby started). With CURVE keys the watch is a CURVE
client like any worker: both brokers of a pair hold the same broker certificate (workers and
gateways check one broker key for both endpoints), so the standby connects with its own key pair to
the active's same public key, and the active admits it if the broker's public certificate is in
the authorised directory (omni-broker refuses to start as a standby otherwise: a refused watch
would look like a dead active and the standby would bind next to it).

Limits, said plainly: a standby must only ever wait for a broker that is bound. Two brokers bound at
once (a cold start of both halves of a pair in the same liveness period, or a partition that hides
A from the standby but not from the workers) split the clients, whose DEALER spreads its messages
over every connected broker; start the first half and wait for its ``ready`` line before starting
the second.
"""

from __future__ import annotations

import logging
import time

import zmq

from omnirelay.security import CurveKeys

from . import protocol as p
from .config import BrokerConfig

log = logging.getLogger("omnirelay.broker")


def _watch_socket(ctx: zmq.Context, endpoint: str, keys: CurveKeys | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    try:
        if keys is not None:
            # The pair shares one broker certificate: the active's public key is our own.
            keys.make_client(sock, keys.server_key or keys.public)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)   # a query to a dead broker is not queued for its return
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        sock.connect(endpoint)
    except BaseException:
        sock.close(0)   # an open socket would keep the context from terminating
        raise
    return sock


def wait_for_takeover(active_endpoint: str, config: BrokerConfig, stop, keys: CurveKeys | None = None) -> bool:
    """Block while the broker at ``active_endpoint`` answers; True when it has been silent for
    ``config.liveness_s`` (take over), False when ``stop()`` became true first."""
    ctx = zmq.Context()
    sock = _watch_socket(ctx, active_endpoint, keys)
    started = last_heard = time.monotonic()
    answering = False
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
                    if not answering:   # said once per stretch of answers: the operator's "standby is armed"
                        answering = True
                        log.info("standby: the active broker at %s answers (after %.1fs)", active_endpoint,
                                 last_heard - started)
            silent = time.monotonic() - last_heard
            if silent > config.liveness_s:
                log.warning("active broker %s silent for %.1fs: taking over", active_endpoint, silent)
                return True
            if answering and silent > config.heartbeat_interval_s * 1.5:
                answering = False
        return False
    finally:
        sock.close(0)
        ctx.term()
