"""The gateway's side of the bus: submit requests, receive token deltas and failures, ask status.

Two sockets, one owner task:

* a DEALER to the broker (submit, cancel, status queries; receives ``RequestFailed``,
  ``StatusReply``, ``Reregister``);
* a PULL bound on ``tcp://<reply_host>:*`` — the ``reply_to`` endpoint that travels with each
  request — where workers push ``TokenDelta`` straight from prefill and decode (a step's deltas
  for this gateway travel as one ``TokenDeltas``, unpacked here into single deltas).

Both sockets refuse a frame over one bus message (libzmq's ``MAXMSGSIZE``: the sender is disconnected
when the frame's header announces more, before anything is allocated), and a message that does not
decode is counted (``malformed``) and logged at most once per :data:`JUNK_LOG_INTERVAL_S` per socket,
so neither a huge frame nor a flood of junk from a peer on the token socket costs memory or a log line
each.

:class:`RequestStream` turns the deltas of one request into an ordered sequence of tokens: it keeps
the next expected position, drops positions already delivered (a replayed stage may resend them)
and holds early ones until the gap fills. A token's logprobs (when the request asked) travel with it
through that reordering, so a position keeps the logprobs of the copy that delivered it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid

import msgspec
import zmq
import zmq.asyncio

from omnirelay.broker import protocol as p
from omnirelay.block_hash import DEFAULT_BLOCK_SIZE
from omnirelay.broker.prefix_index import prompt_route_keys
from omnirelay.errors import BadRequest, DeadlineExceeded, OmniError, WorkerLost, error_from_type
from omnirelay.request_params import adapter_of, salt_of
from omnirelay.security import CurveKeys, require_curve_off_loopback, start_authenticator
from omnirelay.tracing import CURRENT_TRACEPARENT

from .config import GatewayConfig

log = logging.getLogger("omnirelay.gateway")

MAX_FRAME_BYTES = p.MAX_BODY_BYTES + 4096   # one bus message and its envelope, as the broker bounds its socket
JUNK_LOG_INTERVAL_S = 10.0

# Prompt blocks are hashed at omni-worker's default --block-size for prefix-aware routing; the
# broker uses the hint only with prefill workers whose cache has this block size.
PREFIX_BLOCK_SIZE = DEFAULT_BLOCK_SIZE


@dataclasses.dataclass(frozen=True)
class PositionLogprobs:
    """One position's raw logprobs as a worker reported them (``TokenDelta.logprobs`` …): the
    chosen token's, and ``top`` ``(token_id, logprob)`` pairs, most likely first."""

    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class StreamEvent:
    tokens: list[int]
    finish_reason: str = ""
    # Aligned with ``tokens`` when any of them came with logprobs (None for one that did not); else empty.
    logprobs: list[PositionLogprobs | None] = dataclasses.field(default_factory=list)


class RequestStream:
    """Ordered tokens of one request. The handler iterates :meth:`events` until a finish or error.
    ``cached_tokens``: the prompt tokens prefill took from its prefix cache (its first token's
    ``TokenDelta.cached_tokens``; 0 until that token came)."""

    def __init__(self, request_id: str, deadline: float):
        self.request_id = request_id
        self.deadline = deadline
        self.next_position = 0
        self.finished = False
        self.cached_tokens = 0
        self.prompt_logprobs: p.PromptLogprobs | None = None   # the first token's, when the request asked
        self._early: dict[int, tuple[int, str, PositionLogprobs | None]] = {}
        self._queue: asyncio.Queue[StreamEvent | OmniError] = asyncio.Queue()

    def on_delta(self, delta: p.TokenDelta) -> None:
        if self.finished:
            return
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        for i, token in enumerate(delta.token_ids):
            position = delta.start + i
            last = i == len(delta.token_ids) - 1
            if position >= self.next_position:
                self._early[position] = (token, delta.finish_reason if last else "", _logprobs_at(delta, i))
        ready, logprobs, reason = [], [], ""
        while self.next_position in self._early and not reason:
            token, reason, position_logprobs = self._early.pop(self.next_position)
            ready.append(token)
            logprobs.append(position_logprobs)
            self.next_position += 1
        if ready:
            self._queue.put_nowait(StreamEvent(ready, reason, logprobs if any(logprobs) else []))
        if reason:
            self.finished = True

    def on_media(self, media: p.MediaResult) -> None:
        """Token streams take no media: a stray MediaResult is ignored (``images.MediaStream`` collects it)."""

    def on_pooled(self, result: p.PooledResult) -> None:
        """Token streams take no vectors: a stray PooledResult is ignored (``pooling_run.PooledStream`` takes it)."""

    def on_error(self, error: OmniError) -> None:
        if not self.finished:
            self.finished = True
            self._queue.put_nowait(error)

    async def events(self):
        """Yield :class:`StreamEvent` until one has a finish reason; raise the request's error."""
        while True:
            remaining = self.deadline - time.time()
            try:
                # asyncio.timeout, not wait_for: no task is created per event (one per token per stream).
                async with asyncio.timeout(max(0.0, remaining)):
                    event = await self._queue.get()
            except TimeoutError:
                raise DeadlineExceeded("request deadline passed while waiting for tokens",
                                       request_id=self.request_id) from None
            if isinstance(event, OmniError):
                raise event
            yield event
            if event.finish_reason:
                return


def _logprobs_at(delta: p.TokenDelta, i: int) -> PositionLogprobs | None:
    if not delta.logprobs:
        return None
    top = list(zip(delta.top_token_ids[i], delta.top_logprobs[i])) if delta.top_token_ids else []
    return PositionLogprobs(delta.logprobs[i], top)


class BusClient:
    def __init__(self, broker_endpoint: str, reply_host: str = "127.0.0.1", keys: CurveKeys | None = None,
                 reply_port: int = 0, worker_wait_s: float = GatewayConfig.worker_wait_s):
        """``reply_port``: the token socket's port (0: any free one; fix it to open a firewall for it).
        ``worker_wait_s``: how long a request submitted through this client waits for a role with no
        live worker (``--worker-wait``; gateway/resubmit.py)."""
        self.worker_wait_s = worker_wait_s
        require_curve_off_loopback(keys, broker_endpoint, f"tcp://{reply_host}:0")
        self.gateway_id = f"gw-{uuid.uuid4().hex[:12]}"
        self._ctx = zmq.asyncio.Context()
        self._keys = keys
        self._auth = None
        self._dealer = self._ctx.socket(zmq.DEALER)
        if keys:
            keys.make_client(self._dealer)
        self._dealer.setsockopt(zmq.IDENTITY, self.gateway_id.encode())
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._dealer.setsockopt(zmq.RECONNECT_IVL, 100)
        self._dealer.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        endpoints = broker_endpoint.split(",")
        if len(endpoints) > 1:
            # An active broker and its standby (broker/standby.py): only one is bound at a time, and
            # IMMEDIATE sends only to a connected one, never into the dead one's pipe.
            self._dealer.setsockopt(zmq.IMMEDIATE, 1)
        for endpoint in endpoints:
            self._dealer.connect(endpoint)
        self._pull = self._ctx.socket(zmq.PULL)
        self.reply_key = ""
        if keys and keys.authorized_dir:
            # Workers push tokens here: the same CURVE rule as the broker, with our own key.
            keys.make_server(self._pull)
            self.reply_key = keys.public.decode("ascii")
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._pull.setsockopt(zmq.RCVHWM, 1_000_000)
        self._pull.bind(f"tcp://{reply_host}:{reply_port or '*'}")
        self.reply_to = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._streams: dict[str, RequestStream] = {}
        self._status_waiters: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self.malformed = 0
        self.broker_id = ""
        self.session = 0   # HelloAck.session: a new one means the broker gave this gateway up
        self.broker_restarts = 0
        self.sessions_lost = 0

    # ------------------------------------------------------------------ lifecycle (owned by the app)

    async def start(self) -> None:
        if self._keys and self._keys.authorized_dir:
            self._auth = start_authenticator(self._ctx, self._keys)
        self._tasks = [asyncio.create_task(self._read(self._dealer, "broker", self._on_broker_message),
                                           name="bus-broker-reader"),
                       asyncio.create_task(self._read(self._pull, "a worker", self._on_worker_message),
                                           name="bus-token-reader"),
                       asyncio.create_task(self._hello_loop(), name="bus-hello")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for stream in list(self._streams.values()):
            stream.on_error(OmniError("gateway is shutting down", request_id=stream.request_id))
        self._dealer.close(0)
        self._pull.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # ------------------------------------------------------------------ requests

    async def submit(self, submit: p.Submit, stream: RequestStream | None = None) -> RequestStream:
        """``stream``: where this request's worker messages go (default: a token stream). A text
        prompt headed for prefill gets its prefix hint here (the block keys the broker routes on);
        prompts with inline media do not, since their placeholder ids say nothing about the media."""
        if (not submit.prefix_hashes and not submit.inputs and "prefill" in submit.stages
                and len(submit.prompt_token_ids) > PREFIX_BLOCK_SIZE):
            keys = prompt_route_keys(submit.prompt_token_ids, PREFIX_BLOCK_SIZE,   # an adapter's and a salt's
                                     lora=adapter_of(submit.params), salt=salt_of(submit.params))   # are their own
            submit = msgspec.structs.replace(submit, prefix_hashes=keys, prefix_block_size=PREFIX_BLOCK_SIZE)
        if not submit.traceparent and (traceparent := CURRENT_TRACEPARENT.get()):
            submit = msgspec.structs.replace(submit, traceparent=traceparent)   # the request's span is traced
        if stream is None:
            stream = RequestStream(submit.request_id, submit.deadline)
            stream.next_position = submit.position_offset
        self._streams[submit.request_id] = stream
        await self._dealer.send_multipart(p.encode(submit))
        return stream

    async def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        self._streams.pop(request_id, None)
        await self._dealer.send_multipart(p.encode(p.Cancel(request_id, reason)))

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def status(self, timeout: float) -> p.StatusReply | None:
        query_id = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._status_waiters[query_id] = future
        try:
            await self._dealer.send_multipart(p.encode(p.StatusQuery(query_id)))
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self._status_waiters.pop(query_id, None)

    # ------------------------------------------------------------------ readers

    async def _read(self, sock: zmq.asyncio.Socket, source: str, handle) -> None:
        """Decode every message arriving on ``sock`` and hand it to ``handle``; drop malformed ones
        (counted; logged at most once per JUNK_LOG_INTERVAL_S, with how many were dropped since)."""
        logged_at, dropped = -JUNK_LOG_INTERVAL_S, 0
        while True:
            frames = await sock.recv_multipart()
            try:
                msg = p.decode(frames)
            except p.ProtocolError as exc:
                self.malformed += 1
                dropped += 1
                now = time.monotonic()
                if now - logged_at >= JUNK_LOG_INTERVAL_S:
                    log.warning("malformed message from %s: %s (%d dropped since the last such line, this one "
                                "included; at most one line per %.0f s)", source, exc, dropped, JUNK_LOG_INTERVAL_S)
                    logged_at, dropped = now, 0
                continue
            handle(msg)

    def _on_broker_message(self, msg: p.Message) -> None:
        if isinstance(msg, p.RequestFailed):
            stream = self._streams.get(msg.request_id)
            if stream is not None:
                stream.on_error(error_from_type(msg.error_type, msg.message, request_id=msg.request_id,
                                                stage=msg.stage, retry_after=msg.retry_after,
                                                resumable=msg.resumable))
        elif isinstance(msg, p.HelloAck):
            if self.broker_id and msg.broker_id != self.broker_id:
                self._on_broker_restart()
            elif self.broker_id and msg.session != self.session:
                self._on_session_lost()
            self.broker_id, self.session = msg.broker_id, msg.session
        elif isinstance(msg, p.StatusReply):
            future = self._status_waiters.get(msg.query_id)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, p.ErrorReply):
            log.warning("broker rejected a message: %s: %s", msg.error_type, msg.message)
            stream = self._streams.get(msg.request_id) if msg.request_id else None
            if stream is not None:   # a Submit it could not read: fail the request now, not at its deadline
                stream.on_error(BadRequest(f"the broker refused the request: {msg.message}",
                                           request_id=msg.request_id))

    def _on_worker_message(self, msg: p.Message) -> None:
        if isinstance(msg, p.TokenDelta):
            self._on_delta(msg)
        elif isinstance(msg, p.TokenDeltas):
            for delta in msg.deltas:
                self._on_delta(delta)
        elif isinstance(msg, p.MediaResult):
            stream = self._streams.get(msg.request_id)
            if stream is not None:
                stream.on_media(msg)
        elif isinstance(msg, p.PooledResult):
            stream = self._streams.get(msg.request_id)
            if stream is not None:
                stream.on_pooled(msg)

    def _on_delta(self, delta: p.TokenDelta) -> None:
        stream = self._streams.get(delta.request_id)
        if stream is not None:
            stream.on_delta(delta)

    def _on_broker_restart(self) -> None:
        """The broker restarted and forgot every request: each open stream resumes from the
        position it reached (the generation loop resubmits prompt + tokens so far)."""
        log.warning("broker restarted; resuming %d open requests", len(self._streams))
        self.broker_restarts += 1
        for stream in list(self._streams.values()):
            stream.on_error(WorkerLost("broker restarted", request_id=stream.request_id, resumable=True))

    def _on_session_lost(self) -> None:
        """The broker gave this gateway up (it was silent past the broker's liveness: paused, or cut
        off) and dropped its requests: each open stream resumes, as after a broker restart."""
        log.warning("broker forgot this gateway (silent past its liveness); resuming %d open requests",
                    len(self._streams))
        self.sessions_lost += 1
        for stream in list(self._streams.values()):
            stream.on_error(WorkerLost("broker gave this gateway up", request_id=stream.request_id, resumable=True))

    async def _hello_loop(self) -> None:
        while True:
            await self._dealer.send_multipart(p.encode(p.GatewayHello(self.gateway_id)))
            await asyncio.sleep(1.0)
