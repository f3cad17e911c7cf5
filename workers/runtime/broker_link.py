"""The worker's line to the broker, on a thread of its own, so liveness never waits for an engine step.

The runtime's loop runs on one thread: bus messages, engine steps and, inside those, connector
transfers that may take seconds. The broker drops a worker it has not heard from for its liveness
period, so the broker socket must not wait for that thread. The link's thread owns the DEALER
socket and relays frames both ways over an inproc pair::

    loop thread ──send()──▶ inproc pair ──▶ link thread ──▶ broker
    loop thread ◀──recv()── inproc pair ◀── link thread ◀── broker

Liveness. The loop still sends the heartbeats, since only it may read the engine's load. When the
loop has sent none for :data:`KEEPALIVE_AFTER` heartbeat intervals because it is busy (a long
engine step, a slow transfer), the link sends one on its behalf: the load of the loop's last
heartbeat, no prefix-cache changes, and in ``stats`` ``step_age_s``, how long the loop has been in
its current iteration. A long but legitimate step therefore keeps the worker registered, and the
broker's ``/cluster`` view shows how old the step is. Every heartbeat carries ``keepalives``, how
many the link has sent so far: steps longer than a heartbeat interval show up as a rising count.
With the defaults (1 s heartbeats, the broker's 3.5 s liveness) a busy worker is heard from at
least every 1.5 s. The wire protocol is unchanged: a keepalive is an ordinary ``Heartbeat``.

A wedged engine is still detected: once one iteration has lasted ``wedged_after_s`` the link stops
vouching for the loop, so the broker drops the worker after its liveness period and re-dispatches
its idempotent stages. If the loop comes back, its next heartbeat is answered with ``Reregister``
and it registers again.

Threads and sockets. The loop thread starts the link (:meth:`BrokerLink.start`) and stops and joins
it (:meth:`BrokerLink.stop`). No socket is used by two threads: the pair's loop end belongs to the
loop thread; the DEALER and the pair's link end are created, used and closed by the link thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from omnirelay.broker import protocol as p
from omnirelay.security import CurveKeys

log = logging.getLogger("omnirelay.worker")

KEEPALIVE_AFTER = 1.5      # heartbeat intervals of silence from a busy loop before the link speaks for it
RELAY_BATCH = 256          # frames relayed per direction before the link looks at the other side
PIPE_HWM = 100_000         # inproc queue bound; the broker side keeps ZeroMQ's default
STOP_FRAMES = [b""]        # not a protocol message (those have 3 frames): flush and exit
JOIN_TIMEOUT_S = 10.0


class BrokerLinkDown(RuntimeError):
    """The link's thread died; the worker can no longer reach the broker."""


class BrokerLink:
    def __init__(self, ctx: zmq.Context, endpoint: str, worker_id: str, heartbeat_interval_s: float,
                 keys: CurveKeys | None = None, wedged_after_s: float = 300.0,
                 on_inbound: Callable[[], None] | None = None):
        """``on_inbound()``: called on the link's thread after it relayed broker messages to the
        loop (the runtime passes the engine's ``wake``, so a step idly waiting on transfers reads
        a new task at once)."""
        self._ctx = ctx
        self._on_inbound = on_inbound
        self._endpoint = endpoint
        self._identity = worker_id.encode()
        self._keepalive_after_s = KEEPALIVE_AFTER * heartbeat_interval_s
        self._poll_ms = max(1, int(heartbeat_interval_s * 250))   # 4 looks per interval at most
        self._keys = keys
        self.wedged_after_s = wedged_after_s
        self._address = f"inproc://omnirelay-broker-link-{id(self):x}"
        self._pipe: zmq.Socket | None = None            # the loop thread's end
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._setup_error: BaseException | None = None   # why the link's sockets could not be set up
        self._failure: BaseException | None = None        # why the relay stopped
        # Shared between the threads, each written by one only. A write is a single reference
        # assignment (atomic under the GIL) and a stale read costs at most one keepalive.
        self._busy_since: float | None = None           # loop: when its current iteration began
        self._last_load: p.Heartbeat | None = None      # loop: its latest heartbeat
        self._loop_heartbeat_at = 0.0                   # loop
        self._stopping = False                          # loop: no more vouching
        self.keepalives = 0                             # link: heartbeats sent on the loop's behalf
        self._keepalive_at = 0.0                        # link
        self._wedge_logged_for: float | None = None     # link

    # ------------------------------------------------------------------ loop thread

    def start(self) -> None:
        """Open the pipe and start the link's thread; returns once its sockets are connected."""
        self._pipe = self._ctx.socket(zmq.PAIR)
        self._pipe.setsockopt(zmq.LINGER, 0)   # closed only after the link has read everything
        self._pipe.setsockopt(zmq.SNDHWM, PIPE_HWM)
        self._pipe.setsockopt(zmq.RCVHWM, PIPE_HWM)
        self._pipe.bind(self._address)   # bound before the link's end connects: inproc order
        self._thread = threading.Thread(target=self._run, name="broker-link", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._setup_error is not None:
            self._thread.join()
            self._close_pipe()
            raise BrokerLinkDown(f"broker link did not start: {self._setup_error}") from self._setup_error

    def send(self, msg: p.Message) -> None:
        try:
            self._pipe.send_multipart(p.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("broker link full or down; dropped %s", type(msg).__name__)

    def send_heartbeat(self, msg: p.Heartbeat) -> None:
        """Send the loop's heartbeat and keep its load for the keepalives that may follow."""
        self._last_load = msg
        self._loop_heartbeat_at = time.monotonic()
        self.send(msg)

    def poll(self, timeout_ms: int) -> bool:
        """Wait up to ``timeout_ms`` for a broker message. The time between two calls is what the
        link reports as ``step_age_s``: the loop calls this once per iteration."""
        if self._thread is not None and not self._thread.is_alive():
            raise BrokerLinkDown(f"broker link thread died: {self._failure!r}")
        self._busy_since = None
        try:
            return bool(self._pipe.poll(timeout_ms, zmq.POLLIN))
        finally:
            self._busy_since = time.monotonic()

    def step_age_s(self) -> float:
        """How long the loop has been in its current iteration (0 while it waits in :meth:`poll`).
        Any thread may ask (the worker's health endpoint does)."""
        busy_since = self._busy_since
        return 0.0 if busy_since is None else time.monotonic() - busy_since

    @property
    def running(self) -> bool:
        """The link's thread is up (started and not dead). Any thread may ask."""
        return self._thread is not None and self._thread.is_alive()

    def recv(self) -> list[bytes] | None:
        """The next broker message's frames, or None when none is waiting."""
        try:
            return self._pipe.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def stop(self, farewell: p.Message | None = None) -> None:
        """Send ``farewell`` last, let the link relay everything queued, then join it. Idempotent."""
        self._stopping = True
        if self._pipe is None:
            return
        if self._thread.is_alive():
            if farewell is not None:
                self.send(farewell)
            self._pipe.send_multipart(STOP_FRAMES)
            self._thread.join(JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                log.error("broker link thread did not stop within %.0fs", JOIN_TIMEOUT_S)
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None

    # ------------------------------------------------------------------ link thread

    def _run(self) -> None:
        broker = pipe = None
        try:
            broker = self._connect_broker()
            pipe = self._ctx.socket(zmq.PAIR)
            pipe.setsockopt(zmq.LINGER, 0)
            pipe.setsockopt(zmq.SNDHWM, PIPE_HWM)
            pipe.setsockopt(zmq.RCVHWM, PIPE_HWM)
            pipe.connect(self._address)
        except BaseException as exc:   # handed to start(), which raises it on the loop thread
            self._setup_error = exc
            self._ready.set()
            for sock in (broker, pipe):
                if sock is not None:
                    sock.close()
            return
        self._ready.set()
        try:
            self._relay(broker, pipe)
        except BaseException as exc:   # the loop sees it as BrokerLinkDown at its next poll
            self._failure = exc
            log.exception("broker link failed")
        finally:
            pipe.close()
            broker.close()   # LINGER lets what was relayed reach the broker before the context ends

    def _connect_broker(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        try:
            if self._keys:
                self._keys.make_client(sock)
            sock.setsockopt(zmq.IDENTITY, self._identity)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            endpoints = self._endpoint.split(",")
            if len(endpoints) > 1:
                # An active broker and its standby (broker/standby.py): only one is bound at a time.
                # IMMEDIATE queues messages only to a connected broker, never to the dead one's pipe.
                sock.setsockopt(zmq.IMMEDIATE, 1)
            for endpoint in endpoints:
                sock.connect(endpoint)
        except BaseException:
            sock.close(0)   # an open socket would keep the context from terminating
            raise
        return sock

    def _relay(self, broker: zmq.Socket, pipe: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(broker, zmq.POLLIN)
        poller.register(pipe, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(self._poll_ms))
            if broker in ready:
                self._relay_inbound(broker, pipe)
            if pipe in ready and not self._relay_outbound(pipe, broker):
                return
            self._keepalive_if_due(broker)

    def _relay_inbound(self, broker: zmq.Socket, pipe: zmq.Socket) -> None:
        for _ in range(RELAY_BATCH):
            try:
                frames = broker.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                pipe.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                log.warning("worker loop is not reading its broker messages; dropped one")
        if self._on_inbound is not None:
            self._on_inbound()

    def _relay_outbound(self, pipe: zmq.Socket, broker: zmq.Socket) -> bool:
        """Forward the loop's messages to the broker; False once the loop asked the link to stop."""
        for _ in range(RELAY_BATCH):
            try:
                frames = pipe.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if frames == STOP_FRAMES:
                return False
            try:
                broker.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                log.warning("broker send queue full; dropped %s", frames[1][:8].decode(errors="replace"))
        return True

    def _keepalive_if_due(self, broker: zmq.Socket) -> None:
        busy_since, load = self._busy_since, self._last_load
        now = time.monotonic()
        if self._stopping or busy_since is None or load is None:
            return
        if now - max(self._loop_heartbeat_at, self._keepalive_at) < self._keepalive_after_s:
            return
        if now - busy_since > self.wedged_after_s:
            self._report_wedge(busy_since, now)
            return
        self.keepalives += 1
        self._keepalive_at = now
        try:
            # p.encode runs under the GIL without releasing it, so sharing its encoder with the
            # loop thread is safe.
            broker.send_multipart(p.encode(self._keepalive(load, now - busy_since)), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("broker send queue full; dropped a keepalive")

    def _keepalive(self, load: p.Heartbeat, step_age_s: float) -> p.Heartbeat:
        """The loop's last reported load, no prefix-cache changes, and how long the loop is busy."""
        stats = {**load.stats, "step_age_s": round(step_age_s, 3), "keepalives": self.keepalives}
        return p.Heartbeat(worker_id=load.worker_id, running=load.running, waiting=load.waiting,
                           free_kv_blocks=load.free_kv_blocks, stats=stats, reports=load.reports,
                           received=load.received)

    def _report_wedge(self, busy_since: float, now: float) -> None:
        if self._wedge_logged_for != busy_since:
            self._wedge_logged_for = busy_since
            log.error("worker loop has been in one iteration for %.0fs (limit %.0fs): taken as wedged, "
                      "no more heartbeats on its behalf; the broker will drop this worker",
                      now - busy_since, self.wedged_after_s)
