"""The worker process's loop: the only place that touches sockets.

Loop, as a table of contents::

    while running:
        poll the broker link (no wait while the engine has work, else until the next heartbeat)
        handle bus messages: Task → engine, CancelTask → engine, Reregister → register again
        step the engine once and send what it produced (deltas to gateways, stage reports to broker)
        top up credits: grant the broker as many tasks as the engine has room for
        heartbeat when due, or soon after going idle with something not yet reported

The broker socket itself lives on the :class:`~omnirelay.workers.runtime.broker_link.BrokerLink` thread,
which relays this loop's messages and keeps the worker alive at the broker while one step (and the
connector transfers inside it) takes longer than the broker's liveness period. Gateway sockets
stay on this thread (only it sends token deltas), in a :class:`ReplySockets`: bounded in number,
closed when idle, never left open by a failed set-up. A task whose ``reply_to`` is not an endpoint
fails as ``bad_request`` before the engine sees it (the broker refuses such a Submit too).

Shutdown (SIGTERM/SIGINT only flip a flag): stop granting credits, keep stepping until the engine
is empty or ``drain_timeout_s`` passes, report the rest as failed (``worker_lost``, resumable), then
unregister, stop and join the link, and close the sockets.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import zmq

from omnirelay.endpoints import endpoint_error
from omnirelay.errors import BadRequest, WorkerLost
from omnirelay.broker import protocol as p
from omnirelay.broker.prefix_index import route_keys
from omnirelay.connectors.timing import TimedConnector
from omnirelay.lifecycle import Shutdown, ShutdownState
from omnirelay.process_memory import private_bytes
from omnirelay.security import CurveKeys, require_curve_off_loopback
from omnirelay.tracing import Tracing

from omnirelay.workers.runtime.broker_link import BrokerLink
from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.runtime.health_server import WorkerHealth
from omnirelay.workers.runtime.tracing_hook import WorkerTracer
from omnirelay.workers.runtime.reply_sockets import ReplySockets
from omnirelay.workers.runtime.roles import BROKER, Outbound, RoleAdapter

log = logging.getLogger("omnirelay.worker")

# Prefix-cache reports in heartbeats (prefix-aware routing): at most this many block keys per
# heartbeat, and the whole set every PREFIX_FULL_EVERY heartbeats so a lost delta heals.
PREFIX_KEYS_PER_HEARTBEAT = 4096
PREFIX_FULL_EVERY = 30
# An idle worker that sent stage reports or handled tasks since its last heartbeat heartbeats again
# this fraction of an interval after the last one, not a whole interval: the broker then sees it
# settled (p.Heartbeat.reports/received) soon after its last report, and a worker finishing request
# after request still heartbeats at most 1/IDLE_HEARTBEAT_GAP times an interval.
IDLE_HEARTBEAT_GAP = 0.05


class WorkerRuntime:
    def __init__(self, config: WorkerConfig, role: RoleAdapter, engine_stats, shutdown: Shutdown | None = None,
                 keys: CurveKeys | None = None, owned: tuple = (), tracing: Tracing | None = None):
        """``engine_stats()`` returns the counters and load figures that go into heartbeats;
        ``owned`` are resources (connectors, runners, groups) the runtime closes when it stops,
        in order, after the role's engine (:meth:`close`); ``tracing``: spans of traced tasks
        (runtime/tracing_hook.py), its owner shuts it down."""
        require_curve_off_loopback(keys, config.broker)
        self.config = config
        self.role = role
        self.engine_stats = engine_stats
        self.shutdown = shutdown or Shutdown()
        self._keys = keys
        self._owned = owned
        self._ctx = zmq.Context()
        self._link = BrokerLink(self._ctx, config.broker, config.worker_id, config.heartbeat_interval_s, keys,
                                wedged_after_s=config.wedged_after_s, on_inbound=role.engine.wake)
        self._gateways = ReplySockets(self._ctx, keys)
        self._credits_outstanding = 0
        self._tasks: set[str] = set()
        self._prefix_cache = role.prefix_cache
        self._beats_to_full_prefix = 0   # 0: the next heartbeat sends the whole prefix set
        # Freshness (p.Heartbeat.reports/received): stage reports sent, Tasks and CancelTasks
        # handled, and both as the last heartbeat said them.
        self._reports = self._received = 0
        self._beat_counts = (-1, -1)
        self._serving = False            # registered and looping (health(); the loop thread writes it)
        self._tracer = WorkerTracer(tracing, config.role, config.worker_id) if tracing is not None else None
        if self._tracer is not None:   # connector transfers of traced requests become spans too
            for resource in owned:
                if isinstance(resource, TimedConnector):
                    resource.watch(self._tracer.transfer_watcher(resource.name))

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        reason = "worker shut down before the request finished"
        try:
            self._link.start()
            self._register()
            self._serving = True
            self._serve()
        except Exception as exc:   # the engine cannot go on (e.g. a rank of its group died): say why
            reason = f"worker failed: {exc}"
            raise
        finally:
            self._abort_remaining(reason)
            self._link.stop(farewell=p.Unregister(self.config.worker_id))
            self.close()

    def _serve(self) -> None:
        next_heartbeat = last_heartbeat = 0.0
        drain_deadline = None
        while True:
            if self.shutdown.requested and drain_deadline is None:
                self.shutdown.state = ShutdownState.STOPPING
                drain_deadline = time.monotonic() + self.config.drain_timeout_s
                self._revoke_credits()
                log.info("draining %d in-flight requests (timeout %.0fs)", len(self._tasks),
                         self.config.drain_timeout_s)
            if drain_deadline is not None and (not self.role_has_work() or time.monotonic() > drain_deadline):
                break
            now = time.monotonic()
            wait_ms = 0 if self.role_has_work() else max(0, int((next_heartbeat - now) * 1000))
            if self._link.poll(min(wait_ms, 200)):
                self._handle_broker_messages()
            if self.role_has_work():
                out = self.role.step()
                if self._tracer is not None:
                    self._tracer.stepped(out)
                self._send(out)
            if drain_deadline is None:
                self._top_up_credits()
            if not self.role_has_work() and (self._reports, self._received) != self._beat_counts:
                # Idle now: say so, with what the stats count, soon rather than an interval later.
                next_heartbeat = min(next_heartbeat,
                                     last_heartbeat + IDLE_HEARTBEAT_GAP * self.config.heartbeat_interval_s)
            now = time.monotonic()
            if now >= next_heartbeat:
                periodic = now >= last_heartbeat + self.config.heartbeat_interval_s
                self._heartbeat(periodic)
                if periodic:
                    self._gateways.close_idle()
                last_heartbeat = time.monotonic()
                next_heartbeat = last_heartbeat + self.config.heartbeat_interval_s

    def health(self) -> WorkerHealth:
        """The worker's state for its probes (:mod:`~omnirelay.workers.runtime.health_server`). Called
        from the health server's thread: it only reads attributes the loop writes as single references."""
        age = self._link.step_age_s()
        if self._serving and not self._link.running:
            state = "link_down"
        elif age > self.config.wedged_after_s:
            state = "wedged"
        elif self.shutdown.requested:
            state = "draining"
        else:
            state = "serving" if self._serving else "starting"
        return WorkerHealth(state, self.config.role, self.config.worker_id, age)

    def role_has_work(self) -> bool:
        return self.role.engine.has_work

    def _register(self) -> None:
        self._credits_outstanding = 0
        self._beats_to_full_prefix = 0   # a (re)started broker knows nothing of our cache
        block_size = self._prefix_cache.block_size if self._prefix_cache is not None else 0
        self._send_broker(p.Register(worker_id=self.config.worker_id, role=self.config.role,
                                     model=self.config.model_name, capacity=self.config.capacity,
                                     pid=os.getpid(), host=socket.gethostname(), held=sorted(self._tasks),
                                     block_size=block_size, reports=self._reports, received=self._received,
                                     loras=self.role.held_loras()))

    def _handle_broker_messages(self, budget: int = 256) -> None:
        for _ in range(budget):
            frames = self._link.recv()
            if frames is None:
                return
            try:
                msg = p.decode(frames)
            except p.ProtocolError as exc:
                log.warning("dropping malformed message from broker: %s", exc)
                continue
            if isinstance(msg, (p.Task, p.CancelTask)):
                self._received += 1   # counted before handling: the next heartbeat is made after it
            if isinstance(msg, p.Task):
                self._credits_outstanding -= 1
                if self.shutdown.requested:
                    self._send([self.role.failure(msg.request_id, msg.stage, WorkerLost.error_type, "worker is draining",
                                                  attempt=msg.attempt)])
                    continue
                if reason := endpoint_error(msg.reply_to):   # the broker checks too; a bus peer may not have
                    self._send([self.role.failure(msg.request_id, msg.stage, BadRequest.error_type,
                                                  f"reply_to: {reason}", attempt=msg.attempt)])
                    continue
                self._tasks.add(msg.request_id)
                if msg.reply_to:
                    self._gateways.note_key(msg.reply_to, msg.reply_key)
                if self._tracer is not None and msg.traceparent:
                    self._tracer.task_started(msg)
                self._send(self.role.accept(msg))
            elif isinstance(msg, p.CancelTask) and msg.streams_only:
                self.role.close_stream(msg.request_id)
            elif isinstance(msg, p.CancelTask):
                self._tasks.discard(msg.request_id)
                if self._tracer is not None:
                    self._tracer.cancelled(msg.request_id)
                self.role.cancel(msg.request_id)
                self.role.release(msg.inputs)
            elif isinstance(msg, p.Reregister):
                log.info("broker asked to re-register (%s)", msg.reason)
                self._register()
            elif isinstance(msg, p.ErrorReply):
                log.warning("broker rejected a message: %s: %s", msg.error_type, msg.message)

    def _top_up_credits(self) -> None:
        room = self.config.capacity - self.role.engine.num_requests - self._credits_outstanding
        if room > 0:
            self._credits_outstanding += room
            self._send_broker(p.Credit(self.config.worker_id, room))

    def _revoke_credits(self) -> None:
        """Draining: take back the credits the broker still holds, so it sends no more tasks."""
        if self._credits_outstanding > 0:
            self._send_broker(p.Credit(self.config.worker_id, -self._credits_outstanding))
            self._credits_outstanding = 0

    def _heartbeat(self, periodic: bool = True) -> None:
        """``periodic``: an interval's heartbeat, not an early one sent on going idle (those do not
        count towards the next full prefix report)."""
        # Read together: the stats include every request whose report was sent before this point.
        stats, (reports, received) = self.engine_stats(), (self._reports, self._received)
        self._beat_counts = (reports, received)
        stats["keepalives"] = self._link.keepalives   # steps that outlasted a heartbeat interval
        private = private_bytes()
        if private is not None:
            stats["private_memory_bytes"] = private
        self._link.send_heartbeat(p.Heartbeat(worker_id=self.config.worker_id, running=stats.pop("running", 0),
                                              waiting=stats.pop("waiting", 0),
                                              free_kv_blocks=stats.pop("free_kv_blocks", -1), stats=stats,
                                              reports=reports, received=received, loras=self.role.held_loras(),
                                              **self._prefix_report(periodic)))

    def _prefix_report(self, periodic: bool) -> dict:
        """Heartbeat fields for prefix-aware routing: the route keys of blocks cached and evicted
        since the last heartbeat, or the whole (bounded) set after registering, when the changes
        overflow the bound, and every PREFIX_FULL_EVERY periodic heartbeats."""
        cache = self._prefix_cache
        if cache is None:
            return {}
        added, evicted = cache.prefix_events()
        self._beats_to_full_prefix -= periodic
        if self._beats_to_full_prefix < 0 or len(added) + len(evicted) > PREFIX_KEYS_PER_HEARTBEAT:
            self._beats_to_full_prefix = PREFIX_FULL_EVERY
            return {"prefix_full": True,
                    "prefix_added": route_keys(cache.prefix_names()[-PREFIX_KEYS_PER_HEARTBEAT:])}
        return {"prefix_added": route_keys(added), "prefix_evicted": route_keys(evicted)}

    def _abort_remaining(self, reason: str) -> None:
        for request_id in sorted(self._tasks):
            report = self.role.failure(request_id, self.role.role, WorkerLost.error_type, reason)
            self.role.cancel(request_id)
            self._send([report])
        self._tasks.clear()

    # ------------------------------------------------------------------ sending

    def _send(self, out: list[Outbound]) -> None:
        for dest, msg in out:
            if isinstance(msg, (p.StageDone, p.StageFailed)):
                self._tasks.discard(msg.request_id)
                if self._tracer is not None:
                    self._tracer.reported(msg)
            if isinstance(msg, (p.StageDone, p.StageFailed, p.StageStreaming)):
                self._reports += 1
            if dest == BROKER:
                self._send_broker(msg)
            else:
                if self._tracer is not None and isinstance(msg, p.MediaResult):
                    self._tracer.pushed(msg)
                self._send_gateway(dest, msg)

    def _send_broker(self, msg: p.Message) -> None:
        self._link.send(msg)

    def _send_gateway(self, endpoint: str, msg: p.Message) -> None:
        self._gateways.send(endpoint, msg)

    def close(self) -> None:
        """The engine first (its threads may use the connector), then what the role's builder
        handed over, in order, then the sockets."""
        if self._tracer is not None:
            self._tracer.close()
        for resource in (self.role.engine, *self._owned):
            try:
                resource.close()
            except Exception:   # closing one resource must not keep the others open
                log.exception("closing %s failed", type(resource).__name__)
        self._gateways.close()
        self._link.stop()   # already stopped by run(); here for a runtime that never ran
        self._ctx.term()
