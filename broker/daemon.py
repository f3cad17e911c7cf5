"""``omni-broker``: the process that owns the broker's ROUTER socket and feeds :class:`BrokerCore`.

Loop: poll the socket (at most one tick interval) → drain it: decode each message, reject malformed
ones with an :class:`~omnirelay.broker.protocol.ErrorReply`, hand the rest to the core and collect
what it returns → send the pass's replies together → run the core's tick when due. No byte sequence
from a peer can stop this loop: decoding errors are counted and answered, and the core only ever
sees validated messages.
"""

from __future__ import annotations

import argparse
import gc
import logging
import time

import zmq
import zmq.auth

from omnirelay.lifecycle import Shutdown, add_logging_arguments, setup_logging
from omnirelay.scheduling import POLICIES, PRIORITY_AGING_S
from omnirelay.tracing import Tracing, add_tracing_arguments, tracing_from_args
from omnirelay.security import (CurveKeys, SecurityError, add_curve_arguments, keys_from_args,
                                require_curve_off_loopback, start_authenticator)

from . import protocol as p
from .config import BrokerConfig
from .core import BrokerCore
from .tracing_hook import BrokerTracer

log = logging.getLogger("omnirelay.broker")

# The hot path calls libzmq through pyzmq's compiled socket with plain integer flags: the Python
# convenience layer (keyword handling, IntFlag arithmetic per frame) cost as much as the routing.
_send_frame = zmq.backend.Socket.send
_recv_frame = zmq.backend.Socket.recv
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
_VERSION_FRAME = p.VERSION_FRAME
_get_option = zmq.backend.Socket.get
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


# What a gateway sends: held back during a take-over's warm-up (see BrokerDaemon).
_GATEWAY_MESSAGES = (p.GatewayHello, p.Submit, p.Cancel)


class BrokerDaemon:
    def __init__(self, config: BrokerConfig, shutdown: Shutdown | None = None, keys: CurveKeys | None = None,
                 warm_up_s: float = 0.0, tracing: Tracing | None = None):
        """``warm_up_s``: for this long after binding, hold the gateways' messages back (and then
        hand them to the core in order) while the workers find this broker and register. A standby
        that takes over starts with no workers, and would otherwise fail every request resubmitted
        in its first moments as ``unavailable`` (no live worker) instead of resuming it.
        ``tracing``: spans of traced requests (broker/tracing_hook.py); its owner shuts it down."""
        require_curve_off_loopback(keys, config.endpoint)
        self.config = config
        self.core = BrokerCore(config)
        self._tracer = BrokerTracer(tracing) if tracing is not None else None
        self._warm_until = time.time() + warm_up_s if warm_up_s > 0 else 0.0
        self._held: list = []
        self.shutdown = shutdown or Shutdown()
        self._ctx = zmq.Context()
        self._auth = start_authenticator(self._ctx, keys) if keys else None
        self._sock = self._ctx.socket(zmq.ROUTER)
        if keys:
            keys.make_server(self._sock)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)   # a reconnecting worker takes its identity back
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        # Refuse oversized frames in libzmq, before they are buffered in memory.
        self._sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_BODY_BYTES + 4096)
        self._sock.bind(config.endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        tick_ms = int(self.config.heartbeat_interval_s * 1000 / 2)
        next_tick = now = time.time()
        log.info("broker listening on %s", self.endpoint)
        try:
            while not self.shutdown.requested:
                ready = poller.poll(tick_ms)
                now = self._own_silence(now, tick_ms / 1000)
                if ready:
                    self._drain_socket()
                now = self._own_silence(now, 0.0)   # the tick below runs on this very reading
                if self._warm_until and now >= self._warm_until:
                    self._end_warm_up(now)
                if now >= next_tick:
                    try:
                        self._send(self._traced(self.core.tick(now)))
                    except Exception:   # same rule as handlers: log, count, keep serving
                        log.exception("broker tick failed")
                        self.core.counters["handler_errors"] += 1
                    next_tick = now + tick_ms / 1000
        finally:
            if self._tracer is not None:
                self._tracer.close()
            self._sock.close(0)
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()

    def _end_warm_up(self, now: float) -> None:
        held, self._held, self._warm_until = self._held, [], 0.0
        log.info("warm-up over with %d workers registered: handing on %d held gateway messages",
                 len(self.core.workers), len(held))
        out: list = []
        for identity, msg in held:
            try:
                if self._tracer is not None:
                    self._tracer.inbound(msg)
                out += self.core.on_message(identity, msg, now)
            except Exception:   # the same rule as in _drain_socket
                log.exception("broker failed handling %s", type(msg).__name__)
                self.core.counters["handler_errors"] += 1
        self._send(self._traced(out))

    def _traced(self, out: list) -> list:
        return out if self._tracer is None else self._tracer.after_pass(out, self.core)

    def _drain_socket(self, budget: int = 2048) -> None:
        sock, core, decode, clock = self._sock, self.core, p.decode, time.time
        warming = self._warm_until > 0
        tracer = self._tracer
        # Replies wait until the pass has read what is queued: libzmq's I/O thread then writes them
        # out in a few syscalls instead of being woken for every reply or two, and each peer gets
        # its replies in one burst (in the benchmark: half the context switches, ~1.3x the messages
        # per CPU-second; flushing every 64 or 256 replies kept most of the wake-ups). The cost is
        # latency under saturation only: a pass ends as soon as the socket is empty, so a reply
        # waits at most for ``budget`` messages (~15 ms at full load, when queueing dominates anyway).
        pending: list = []
        for handled in range(budget):
            if handled == 1 and not _get_option(sock, _EVENTS) & _POLLIN:
                # One message so far, as on a quiet broker: asking whether another waits (~1 µs)
                # sends the reply sooner than failing a receive would (a zmq.Again costs ~4 µs).
                break
            try:
                # A ROUTER hands out the sender's identity first, always with at least one frame
                # after it: the identity needs no "more" check, so it comes as plain bytes (a Frame
                # object per frame costs more than the routing itself).
                identity = _recv_frame(sock, _NOBLOCK, True)
            except zmq.Again:
                break
            # Frame.more avoids a getsockopt (and its option-enum conversion) per frame.
            frame = _recv_frame(sock, 0, False)
            frames = [frame.bytes]
            while frame.more:
                frame = _recv_frame(sock, 0, False)
                frames.append(frame.bytes)
            try:
                msg = decode(frames)
            except p.ProtocolError as exc:
                core.counters["malformed_messages"] += 1
                pending.append((identity, p.ErrorReply("malformed_message", str(exc)[:500],
                                                       request_id=p.submitted_request_id(frames))))
                continue
            if warming and isinstance(msg, _GATEWAY_MESSAGES):
                self._held.append((identity, msg))
                continue
            if tracer is not None:
                tracer.inbound(msg)
            try:
                pending += core.on_message(identity, msg, clock())
            except Exception:  # a bug in one handler must not take the cluster's broker down
                log.exception("broker failed handling %s", type(msg).__name__)
                core.counters["handler_errors"] += 1
        if tracer is not None:   # also when nothing is sent: a request may have just finished
            pending = tracer.after_pass(pending, core)
        if pending:
            self._send(pending)

    def _own_silence(self, since: float, expected_s: float) -> float:
        """The time now. First, when more than ``expected_s`` and a heartbeat interval passed since
        ``since``, this process did not run meanwhile (stopped, starved of CPU): the silence of its
        peers then was its own, and the core does not count it against their liveness. Checked on
        both sides of a drain, so no tick runs on a reading taken across such a gap."""
        now = time.time()
        stalled = now - since - expected_s
        if stalled > self.config.heartbeat_interval_s:
            log.warning("broker did not run for %.1fs; that time does not count against liveness", stalled)
            self.core.forgive_silence(stalled)
        return now

    def _send(self, out) -> None:
        sock, encode_body = self._sock, p.encode_body
        for identity, msg in out:
            try:
                # The frames of p.encode, without building its list per message.
                body = encode_body(msg)
                # ROUTER queues whole messages: once the first frame is accepted the rest are too.
                _send_frame(sock, identity, _NOBLOCK | _SNDMORE)
                _send_frame(sock, _VERSION_FRAME, _SNDMORE)
                _send_frame(sock, msg.TAG, _SNDMORE)
                _send_frame(sock, body, 0)
            except zmq.Again:
                self.core.counters["dropped_sends"] += 1
            except zmq.ZMQError as exc:
                log.warning("send to %r failed: %s", identity[:32], exc)
            except Exception:   # an unencodable message must not end the loop for everyone else
                log.exception("could not encode %s", type(msg).__name__)
                self.core.counters["send_errors"] += 1


def _tune_gc() -> None:
    """Collect less often in the broker process. Every message allocates a few container objects
    (a request's state, token lists, outgoing tuples) and the default threshold (700) ran a young
    collection every ~100 messages, a few per cent of the broker's CPU; the broker builds no
    reference cycles on its hot path, so a rarer collection finds the same garbage. Objects from
    start-up (modules, config) are frozen out of every later collection. Process-wide, hence here in
    the entry point and not in :class:`BrokerDaemon`, which tests also run inside other processes."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def _require_admits_own_key(keys: CurveKeys) -> None:
    """A standby watches the active broker as a CURVE client with the pair's shared broker key; the
    active admits it only if that key's public certificate is authorised. Checked up front: a watch
    the active refuses looks like a dead active, and the standby would bind next to a live one."""
    if keys.public in zmq.auth.load_certificates(keys.authorized_dir):   # what the ZAP handler admits
        return
    raise SecurityError(f"--standby-of with CURVE: the broker's public certificate is not in {keys.authorized_dir} "
                        "(both brokers of a pair hold the same broker key, and each must admit the other)")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-broker", description="omnirelay control-plane broker")
    parser.add_argument("--endpoint", default=BrokerConfig.endpoint, help="ZeroMQ endpoint to bind")
    parser.add_argument("--heartbeat-interval", type=float, default=BrokerConfig.heartbeat_interval_s)
    parser.add_argument("--liveness", type=float, default=BrokerConfig.liveness_s)
    parser.add_argument("--expect-back", type=float, default=BrokerConfig.expect_back_s, metavar="SECONDS",
                        help="a worker dropped for silence (stopped, starved, killed and being restarted) is "
                             "expected back for this long: a role whose only workers are expected back holds its "
                             "requests in its queue until one registers (or their deadline passes) instead of "
                             "failing them as unavailable; 0: never (default %(default)s; broker/expected.py)")
    parser.add_argument("--max-queue-per-role", type=int, default=BrokerConfig.max_queue_per_role)
    parser.add_argument("--retry-backoff", type=float, default=BrokerConfig.retry_backoff_s, metavar="SECONDS",
                        help="wait before restarting a request after a failed transfer; it doubles with each "
                             "further attempt (0: restart at once; default %(default)s)")
    parser.add_argument("--retry-backoff-max", type=float, default=BrokerConfig.retry_backoff_max_s,
                        metavar="SECONDS", help="cap of that wait (default %(default)s)")
    parser.add_argument("--scheduling-policy", choices=POLICIES, default=BrokerConfig.scheduling_policy,
                        help="fcfs: queues in arrival order; priority: lowest request priority first, aged by "
                             "1 per %g s waited so nobody starves (default %%(default)s)" % PRIORITY_AGING_S)
    parser.add_argument("--standby-of", default=None, metavar="ENDPOINT",
                        help="start as the standby of the broker at ENDPOINT: bind --endpoint and serve only once "
                             "that one has been silent for --liveness (workers and gateways get --broker ACTIVE,STANDBY). "
                             "Symmetric: each broker of a pair names the other, and a dead one restarted with its "
                             "same command line becomes the survivor's standby (broker/standby.py)")
    add_logging_arguments(parser)
    add_curve_arguments(parser, server=True, client=False)
    add_tracing_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> BrokerConfig:
    """The :class:`BrokerConfig` the parsed flags describe (ValueError when they do not make one)."""
    return BrokerConfig(endpoint=args.endpoint, heartbeat_interval_s=args.heartbeat_interval,
                        liveness_s=args.liveness, expect_back_s=args.expect_back,
                        max_queue_per_role=args.max_queue_per_role,
                        retry_backoff_s=args.retry_backoff, retry_backoff_max_s=args.retry_backoff_max,
                        scheduling_policy=args.scheduling_policy)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    setup_logging("omni-broker", args.log_level, args.log_format)
    try:
        config = config_from_args(args)
        keys = keys_from_args(args)
        if keys is not None and not keys.authorized_dir:
            raise SecurityError("the broker needs --curve-authorized-keys with --curve-secret-key")
        if args.standby_of:
            require_curve_off_loopback(keys, args.standby_of)
            if keys is not None:
                _require_admits_own_key(keys)
        shutdown = Shutdown().install()
        if args.standby_of:
            from .standby import wait_for_takeover
            print(f"omni-broker standby of {args.standby_of}", flush=True)
            if not wait_for_takeover(args.standby_of, config, lambda: shutdown.requested, keys):
                return 0
        # After a take-over the workers reach us within a reconnect interval (<= 1 s) and register at
        # their next heartbeat: two heartbeat intervals cover both.
        tracing = tracing_from_args("omni-broker", args)
        daemon = BrokerDaemon(config, shutdown, keys,
                              warm_up_s=2 * config.heartbeat_interval_s if args.standby_of else 0.0, tracing=tracing)
    except ValueError as exc:   # SecurityError included
        parser.error(str(exc))
    print(f"omni-broker ready on {daemon.endpoint}", flush=True)
    _tune_gc()
    try:
        daemon.run()
    finally:
        if tracing is not None:
            tracing.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
