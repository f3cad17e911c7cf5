"""The broker's state machine: membership, per-role queues, credit dispatch, failure handling.

No sockets here: :class:`BrokerCore` takes decoded messages with the sender's identity and the
current time, and returns the messages to send. The daemon (``daemon.py``) owns the ROUTER socket.

Life of a request through the broker::

    Submit ──admit──▶ QUEUED(stage i) ──credit available──▶ RUNNING(stage i, worker w)
                          ▲                                      │ StageDone
                          │ worker w died, stage idempotent      ├──▶ QUEUED(stage i+1) … ──▶ done
                          ├──────────────────────────────────────┤ StageFailed worker_lost: restart now
                          │                                      │ StageFailed transfer_failed:
                          └──── not-before reached ◀── BACKOFF(stage 0) ◀──┘ restart after a delay
                                                                 │ StageFailed / deadline / no worker
                                                                 └──▶ RequestFailed → gateway

Admission rejects early: a full role queue or a role with no live worker fails the request at
once (``overloaded``/``unavailable`` with a retry-after) instead of queueing without bound — unless
a worker of the role that was dropped for silence is expected back (:mod:`~omnirelay.broker.expected`):
then the request is admitted and held in the role's queue (the same bound, its deadline enforced by
:meth:`BrokerCore.tick`) and dispatched when a worker of the role registers and grants credit; when
the last expectation lapses with no worker back, the role's queue fails as ``unavailable``.
Dispatch is by credit: a worker grants credits, the broker never sends more tasks than granted,
and picks the least-loaded worker of the role — or, for a request with prefix hints, the worker
that caches the longest prefix of its prompt unless that one is much busier
(:mod:`~omnirelay.broker.prefix_index`); for a request under a LoRA adapter, a worker that holds
the adapter unless that one is much busier (:mod:`~omnirelay.broker.lora_affinity`). The
least-loaded worker comes from a per-pool heap of
load entries (:meth:`BrokerCore._pick_least`), so a dispatch costs O(log pool) rather than a scan
of the pool: with 700 workers in a role the scan cost ~1 ms a dispatch and capped one broker at
~2k requests/s (``benchmarks/broker_sim.py``). Workers that miss heartbeats for ``liveness``
seconds are dropped; their idempotent stages (everything but decode) go back to the front of the
queue, and a decode stream is reported ``resumable`` so the gateway can resume it elsewhere.

Streamed hand-offs: a running stage may send ``StageStreaming`` (its successor can start on a
hand-off it keeps writing, e.g. decode's spoken reply in chunks). The request then moves to the next
stage at once and remembers the sender as its ``producer_id`` until the producer's own StageDone or
StageFailed; the last stage finishing first leaves the request open (``stages_done``) until then.
Such a consumer reads chunks nobody can write again, so losing either side fails the request as
``resumable`` (the gateway submits it again and skips what the client already has), and a cancel
or failure tells both workers.

A failed transfer restarts the request from its first stage, but not at once: a flapping connector
or store would fail the retry the same way, so the request waits in ``BACKOFF`` for a delay that
doubles with each attempt up to ``retry_backoff_max_s``. The broker never sleeps: a heap ordered by
not-before time is drained by :meth:`BrokerCore.tick` and after every message, so the delay is kept
to within the daemon's tick interval. A retry that could not start before the request's deadline
fails at once with ``deadline_exceeded``; a final ``transfer_failed`` carries a retry-after hint.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import uuid
import logging

import msgspec

from omnirelay.endpoints import endpoint_error
from omnirelay.errors import BadRequest, DeadlineExceeded, Overloaded, TransferFailed, Unavailable, WorkerLost

from . import protocol as p
from .config import BrokerConfig
from .expected import ExpectedWorkers
from .lora_affinity import AdapterHolders, request_adapter
from .prefix_index import MAX_PROMPT_BLOCKS, PrefixSet, pick_worker
from .records import BACKOFF, QUEUED, RUNNING, RequestState, WorkerState
from .role_queue import PriorityRoleQueue

log = logging.getLogger("omnirelay.broker")

MAX_STAGES = 8
IDEMPOTENT_STAGES = frozenset({"encode", "prefill", "generate"})
# A failure of these kinds may succeed when the request starts over on other workers.
RETRYABLE_ERRORS = frozenset({TransferFailed.error_type, WorkerLost.error_type})
# … of which these wait before the restart: the same connector or store is likely to fail again at
# once. A worker_lost report comes from a draining worker, and another worker can take over now.
BACKOFF_ERRORS = frozenset({TransferFailed.error_type})
MAX_GOOD_ENDPOINTS = 4096   # bound of the checked-endpoint cache (one per gateway in practice)

Outgoing = tuple[bytes, p.Message]


class BrokerCore:
    def __init__(self, config: BrokerConfig):
        self.config = config
        self.workers: dict[str, WorkerState] = {}
        # The same workers indexed by (model, role): dispatch and admission look at one pool, never
        # scan the registry. A key exists only while its pool has a live worker.
        self.pools: dict[tuple[str, str], dict[str, WorkerState]] = {}
        self.requests: dict[str, RequestState] = {}
        # FIFO deques under fcfs; under --scheduling-policy priority, lowest aged priority first
        # (broker/role_queue.py, the rule in omnirelay/scheduling.py).
        self.queues: dict[tuple[str, str], collections.deque[str] | PriorityRoleQueue] = collections.defaultdict(
            self._new_queue if config.scheduling_policy == "priority" else collections.deque)
        self.counters: collections.Counter[str] = collections.Counter()
        self.gateways: dict[bytes, float] = {}   # identity → last hello, for gateways that say hello
        # identity → the session it was given (HelloAck.session): a new one whenever a gateway is
        # taken (back) in, so one given up while silent learns that its requests are gone.
        self._gateway_sessions: dict[bytes, int] = {}
        self._sessions = itertools.count(1)
        # identity → when it was last told to register again (once per heartbeat interval, see _unknown_worker)
        self._told_to_reregister: dict[bytes, float] = {}
        self.broker_id = uuid.uuid4().hex
        self._now = 0.0   # time of the event being handled (stamps dispatches)
        # Requests in BACKOFF as (not_before, seq, request_id, attempt). Entries of requests that were
        # cancelled, failed or restarted meanwhile stay until due and are skipped then: the delay is
        # capped, so the heap holds at most one entry per restart of the last few seconds.
        self._backoff: list[tuple[float, int, str, int]] = []
        self._backoff_seq = itertools.count()
        self._stage_keys: dict[str, tuple[str, str]] = {}
        # Per pool, a heap of (assigned, -credits, dispatched, seq, worker) — the least-loaded order
        # of prefix_index._load. Entries go stale as loads change: every load increase (a dispatch)
        # and decrease (a finished or dropped task, new credit) pushes a fresh one, and a stale
        # entry met at the top is refreshed or dropped (_pick_least), so every worker with credit
        # keeps at least one entry. Rebuilt when stale entries outnumber the pool (_offer).
        self._ready: dict[tuple[str, str], list] = {}
        self._ready_seq = itertools.count()
        self._prefix_workers: collections.Counter[tuple[str, str]] = collections.Counter()
        self._adapters = AdapterHolders(config.lora_load_slack)   # LoRA affinity: who holds which adapter
        # reply_to endpoints already checked (a gateway sends the same one with every Submit).
        self._good_endpoints: set[str] = set()
        self._priority = config.scheduling_policy == "priority"   # else Task.priority stays 0
        # Workers dropped for silence, expected back for a while: their roles hold requests meanwhile.
        self.expected = ExpectedWorkers(config.expect_back_s, config.max_workers)

    def _new_queue(self) -> PriorityRoleQueue:
        return PriorityRoleQueue(lambda request_id: self.requests[request_id].spec.priority, lambda: self._now)

    # ------------------------------------------------------------------ entry points

    def on_message(self, identity: bytes, msg: p.Message, now: float) -> list[Outgoing]:
        self._now = now
        if identity in self.gateways:
            self.gateways[identity] = now
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.counters["unexpected_messages"] += 1
            return [(identity, p.ErrorReply("unexpected_message", f"{type(msg).__name__} is not for the broker"))]
        out = handler(self, identity, msg, now)
        if self._backoff and self._backoff[0][0] <= now:
            # Between ticks too: a busy broker then keeps the delay close to what was asked.
            out += self._end_backoffs(now)
        return out

    def tick(self, now: float) -> list[Outgoing]:
        """Expire silent workers, fail requests past their deadline, queue again the requests whose
        retry delay is over."""
        self._now = now
        out: list[Outgoing] = []
        for worker in [w for w in self.workers.values() if now - w.last_seen > self.config.liveness_s]:
            log.warning("worker %s (%s, pid %d) missed heartbeats; dropping it", worker.worker_id,
                        worker.role, worker.pid)
            self.counters["workers_expired"] += 1
            out += self._drop_worker(worker, now, expected_back=True)
        for req in [r for r in self.requests.values() if now > r.spec.deadline]:
            if req.phase is BACKOFF:
                where = "while waiting to retry after a failed transfer"
            elif req.phase is QUEUED and not self._has_live(req.spec.model, req.stage):
                where = f"while waiting for a {req.stage} worker to come back"
            else:
                where = f"in stage {req.stage}"
            out += self._fail(req, DeadlineExceeded.error_type, f"deadline passed {where}")
        for model, role in self.expected.expire(now):
            if not self._has_live(model, role):
                log.warning("no %s worker of model %s came back within %gs; failing its queue", role, model,
                            self.config.expect_back_s)
                out += self._fail_queued_without_worker(model, role, f" (none came back within "
                                                                     f"{self.config.expect_back_s:g}s)")
        out += self._expire_gateways(now)
        if self._told_to_reregister:
            interval = self.config.heartbeat_interval_s
            self._told_to_reregister = {i: t for i, t in self._told_to_reregister.items() if now - t < interval}
        if self._backoff and self._backoff[0][0] <= now:
            out += self._end_backoffs(now)
        return out

    def forgive_silence(self, seconds: float) -> None:
        """The broker itself did not run for ``seconds`` (stopped, starved of CPU): nobody could be
        heard meanwhile, so that time does not count against any worker's or gateway's liveness
        (the daemon calls this when its loop comes back late; a broker paused past the liveness
        period would otherwise drop every healthy worker and gateway at its next tick)."""
        for worker in self.workers.values():
            worker.last_seen += seconds
        for identity in self.gateways:
            self.gateways[identity] += seconds
        self.counters["broker_stalls"] += 1

    def status(self, now: float) -> p.StatusReply:
        workers = [w.describe(now) for w in self.workers.values()]
        return p.StatusReply(query_id=0, workers=workers,
                             queued={f"{m}/{r}": len(q) for (m, r), q in self.queues.items()},
                             counters=dict(self.counters), requests=len(self.requests),
                             unsettled=sum(not w["settled"] for w in workers))

    # ------------------------------------------------------------------ workers

    def _on_register(self, identity: bytes, msg: p.Register, now: float) -> list[Outgoing]:
        old = self.workers.get(msg.worker_id)
        if old is not None and old.identity != identity and now - old.last_seen <= self.config.liveness_s:
            # A live worker's id claimed from another connection (a worker's bus identity is its id,
            # so its own restart comes from the same one): refused, or the claimant takes its tasks.
            self.counters["rejected_registrations"] += 1
            log.warning("refused worker id %s from another bus identity while it is alive", msg.worker_id)
            return [(identity, p.ErrorReply(BadRequest.error_type,
                                            f"worker id {msg.worker_id} is registered and alive"))]
        if old is None and len(self.workers) >= self.config.max_workers:
            self.counters["rejected_registrations"] += 1
            return [(identity, p.ErrorReply(Overloaded.error_type, f"registry full ({self.config.max_workers} workers)"))]
        worker = WorkerState(
            worker_id=msg.worker_id, identity=identity, role=msg.role, model=msg.model,
            capacity=max(0, msg.capacity), pid=msg.pid, host=msg.host, last_seen=now, reports=msg.reports,
            sent=msg.received)
        if msg.block_size > 0 and self.config.prefix_keys_per_worker > 0:
            worker.block_size, worker.prefix = msg.block_size, PrefixSet(self.config.prefix_keys_per_worker)
        if old is not None:
            self._unindex(old)
        self.workers[msg.worker_id] = worker
        self.expected.returned(msg.worker_id)
        self.pools.setdefault((worker.model, worker.role), {})[worker.worker_id] = worker
        if msg.loras is not None:
            self._adapters.report(worker, msg.loras, msg.received)
        if worker.prefix is not None:
            self._prefix_workers[(worker.model, worker.role)] += 1
        out: list[Outgoing] = []
        if old is not None:
            # The same worker registering again has lost whatever it held (it restarted, or the
            # broker did and it reconnected): its old tasks are lost, but the role is still served.
            out += self._drop_worker(old, now)
        # Requests the worker still runs that this broker does not know (it restarted and their
        # gateways resume them elsewhere): stop them, so no compute is spent on orphans.
        # Whatever it still holds is not its task any more: the broker never knew it (it restarted)
        # or took it back when it dropped the worker (re-queued, or failed for the gateway to resume).
        out += [self._to_worker(worker, p.CancelTask(rid)) for rid in msg.held]
        self._told_to_reregister.pop(identity, None)
        self.counters["registrations"] += 1
        log.info("worker %s registered: role=%s model=%s capacity=%d", msg.worker_id, msg.role,
                 msg.model, msg.capacity)
        return out

    def _unknown_worker(self, identity: bytes, now: float) -> list[Outgoing]:
        """``Reregister`` for a message from a worker the broker does not know, at most once per
        heartbeat interval per identity: a worker back from a pause sends a burst (stage reports,
        credits, a heartbeat) before its Register arrives, and a Register for each answer would
        drop what it was given in between."""
        told = self._told_to_reregister.get(identity)
        if told is not None and now - told < self.config.heartbeat_interval_s:
            return []
        self._told_to_reregister[identity] = now
        return [(identity, p.Reregister("unknown worker"))]

    def _known_worker(self, identity: bytes, worker_id: str, now: float) -> WorkerState | None:
        worker = self.workers.get(worker_id)
        if worker is None or worker.identity != identity:
            return None
        worker.last_seen = now
        return worker

    def _on_credit(self, identity: bytes, msg: p.Credit, now: float) -> list[Outgoing]:
        worker = self._known_worker(identity, msg.worker_id, now)
        if worker is None:
            return self._unknown_worker(identity, now)
        worker.credits = max(0, min(worker.capacity, worker.credits + msg.credits))
        self._offer(worker)
        return self._pump(worker.model, worker.role)

    def _on_heartbeat(self, identity: bytes, msg: p.Heartbeat, now: float) -> list[Outgoing]:
        worker = self._known_worker(identity, msg.worker_id, now)
        if worker is None:
            return self._unknown_worker(identity, now)
        worker.running, worker.waiting = msg.running, msg.waiting
        worker.reported, worker.handled = msg.reports, msg.received
        worker.free_kv_blocks, worker.stats = msg.free_kv_blocks, msg.stats   # shared: see _on_stage_done
        prefix = worker.prefix
        if prefix is not None:
            bound = prefix.capacity
            # A full report, or more evictions than the copy can hold (bounded work per heartbeat):
            # the reported additions become the whole copy.
            if msg.prefix_full or len(msg.prefix_evicted) > bound:
                prefix.replace(msg.prefix_added[-bound:])
            else:
                prefix.discard(msg.prefix_evicted)
                prefix.add(msg.prefix_added[-bound:])
        if msg.loras is not None:
            self._adapters.report(worker, msg.loras, msg.received)
        return []

    def _on_unregister(self, identity: bytes, msg: p.Unregister, now: float) -> list[Outgoing]:
        worker = self._known_worker(identity, msg.worker_id, now)
        if worker is None:
            return []
        log.info("worker %s unregistered", worker.worker_id)
        return self._drop_worker(worker, now)

    def _drop_worker(self, worker: WorkerState, now: float, expected_back: bool = False) -> list[Outgoing]:
        """Take ``worker`` out and its tasks back. ``expected_back``: it was dropped for silence and may
        well speak again (broker/expected.py): its role's requests are held meanwhile."""
        if self.workers.get(worker.worker_id) is worker:
            del self.workers[worker.worker_id]
            self._unindex(worker)
            if expected_back:
                self.expected.expect(worker.worker_id, (worker.model, worker.role), now)
        out: list[Outgoing] = []
        for request_id in sorted(worker.tasks):
            req = self.requests.get(request_id)
            if req is not None and req.producer_id == worker.worker_id:
                # A producer lost mid-stream: its consumer read what nobody can write again.
                req.producer_id = None
                out += self._fail(req, WorkerLost.error_type, f"{worker.role} worker {worker.worker_id} died "
                                  "while streaming to the next stage", resumable=True)
                continue
            if req is None or req.worker_id != worker.worker_id:
                continue
            req.phase, req.worker_id = QUEUED, None
            if req.streamed:   # its consumed chunks are gone: the whole request starts again
                # (What the producer wrote and the dead consumer did not read: _fail hands the
                # queued-again request's inputs to a live worker of the role, which deletes them.)
                out += self._fail(req, WorkerLost.error_type, f"{worker.role} worker {worker.worker_id} died "
                                  "while reading a streamed hand-off", resumable=True)
                continue
            if req.stage in IDEMPOTENT_STAGES and req.attempts + 1 < self.config.max_attempts:
                req.attempts += 1
                self.counters["stage_retries"] += 1
                self.queues[(req.spec.model, req.stage)].appendleft(request_id)
                self._count_held(req.spec.model, req.stage)
            else:
                out += self._fail(req, WorkerLost.error_type, f"{worker.role} worker {worker.worker_id} died",
                                  resumable=req.stage == "decode")
        worker.tasks.clear()
        if not self._serves(worker.model, worker.role):
            out += self._fail_queued_without_worker(worker.model, worker.role)
        out += self._pump(worker.model, worker.role)
        return out

    def _unindex(self, worker: WorkerState) -> None:
        key = (worker.model, worker.role)
        pool = self.pools.get(key)
        if pool is not None and pool.get(worker.worker_id) is worker:
            del pool[worker.worker_id]
            self._adapters.drop(worker)
            if worker.prefix is not None:
                self._prefix_workers[key] -= 1
            if not pool:
                del self.pools[key]
                self._ready.pop(key, None)
                self._prefix_workers.pop(key, None)

    def _has_live(self, model: str, role: str) -> bool:
        return (model, role) in self.pools

    def _serves(self, model: str, role: str) -> bool:
        """Whether (model, role) may take requests: it has a live worker, or one expected back."""
        return (model, role) in self.pools or self.expected.awaited((model, role))

    def _count_held(self, model: str, role: str) -> None:
        """A request joined the queue of a role whose workers are all expected back: held, not failed."""
        if (model, role) not in self.pools:
            self.counters["requests_held"] += 1

    def _fail_queued_without_worker(self, model: str, role: str, why: str = "") -> list[Outgoing]:
        out: list[Outgoing] = []
        for request_id in list(self.queues.get((model, role), ())):
            req = self.requests.get(request_id)
            if req is not None and req.phase is QUEUED:
                out += self._fail(req, Unavailable.error_type, f"no live {role} worker for model {model}{why}",
                                  retry_after=self.config.retry_after_s)
        return out

    # ------------------------------------------------------------------ stages

    def _on_stage_done(self, identity: bytes, msg: p.StageDone, now: float) -> list[Outgoing]:
        worker = self._known_worker(identity, msg.worker_id, now)
        if worker is None:
            return self._unknown_worker(identity, now)
        worker.reports += 1   # counted whatever the report's fate (WorkerState.settled)
        req = self.requests.get(msg.request_id)
        if req is not None and req.producer_id == worker.worker_id and req.attempts == msg.attempt \
                and req.spec.stages[req.stage_index - 1] == msg.stage:
            return self._producer_done(req, worker, msg.stage, now)
        if (req is None or req.worker_id != worker.worker_id or req.stage != msg.stage
                or req.attempts != msg.attempt):
            self.counters["stale_stage_reports"] += 1
            if req is None:
                worker.tasks.discard(msg.request_id)
                if msg.outputs:
                    # The request died while this stage ran (cancel, deadline): nobody will read
                    # what it just wrote, so have its producer delete it now rather than at TTL.
                    return [self._to_worker(worker, p.CancelTask(msg.request_id, inputs=msg.outputs))]
            return []
        worker.tasks.discard(msg.request_id)
        self._offer(worker)
        counters = self.counters
        done_key, seconds_key = self._stage_counter_keys(msg.stage)
        counters[done_key] += 1
        counters[seconds_key] += int((now - req.dispatched_at) * 1e6)  # µs: counters are ints
        if msg.finished or req.stage_index + 1 >= len(req.spec.stages):
            if req.producer_id is not None:   # the stage streaming into this one still runs
                req.worker_id, req.stages_done = None, True
                # Nobody reads its stream any more: it stops writing it (its own output goes on).
                producer = self.workers.get(req.producer_id)
                return [self._to_worker(producer, p.CancelTask(msg.request_id, streams_only=True))] if producer else []
            del self.requests[msg.request_id]
            counters["requests_finished"] += 1
            # A producer that finished first may have written its last chunks after the consumer
            # released what it had not read (their reports cross): it deletes what may be left.
            former = self.workers.get(req.former_producer or "")
            return [self._to_worker(former, p.CancelTask(msg.request_id, streams_only=True))] if former else []
        req.stage_index += 1
        # A decoded message is the broker's own and never changed: its maps are shared, not copied.
        req.inputs, req.phase, req.worker_id = msg.outputs, QUEUED, None
        return self._enqueue(req)

    def _on_stage_streaming(self, identity: bytes, msg: p.StageStreaming, now: float) -> list[Outgoing]:
        """The running stage lets its successor start on a streamed hand-off: dispatch the next
        stage now and keep the sender as the request's producer until it reports."""
        worker = self._known_worker(identity, msg.worker_id, now)
        if worker is None:
            return self._unknown_worker(identity, now)
        worker.reports += 1   # counted whatever the report's fate (WorkerState.settled)
        req = self.requests.get(msg.request_id)
        if (req is None or req.worker_id != worker.worker_id or req.stage != msg.stage
                or req.attempts != msg.attempt or req.stage_index + 1 >= len(req.spec.stages)):
            self.counters["stale_stage_reports"] += 1
            # Nobody will read the stream: its producer deletes what it wrote and stops writing.
            return [self._to_worker(worker, p.CancelTask(msg.request_id, inputs=msg.outputs))]
        self.counters["streamed_handoffs"] += 1
        req.producer_id, req.streamed = worker.worker_id, True
        req.stage_index += 1
        req.inputs, req.phase, req.worker_id = msg.outputs, QUEUED, None
        return self._enqueue(req)

    def _producer_done(self, req: RequestState, worker: WorkerState, stage: str, now: float) -> list[Outgoing]:
        """The stage that streamed into the current one finished writing."""
        worker.tasks.discard(req.spec.request_id)
        self._offer(worker)
        done_key, seconds_key = self._stage_counter_keys(stage)
        self.counters[done_key] += 1
        self.counters[seconds_key] += int((now - req.dispatched_at) * 1e6)
        req.producer_id, req.former_producer = None, worker.worker_id
        if req.stages_done:
            del self.requests[req.spec.request_id]
            self.counters["requests_finished"] += 1
        return self._pump(worker.model, worker.role)

    def _stage_counter_keys(self, stage: str) -> tuple[str, str]:
        """The two counter names of ``stage``'s completions, formatted once per stage name (the
        stage is a request's, so it names a role some worker registered: a small set)."""
        keys = self._stage_keys.get(stage)
        if keys is None:
            keys = self._stage_keys[stage] = (f"stage_done:{stage}", f"stage_seconds:{stage}")
        return keys

    def _on_stage_failed(self, identity: bytes, msg: p.StageFailed, now: float) -> list[Outgoing]:
        worker = self._known_worker(identity, msg.worker_id, now)
        if worker is None:
            return self._unknown_worker(identity, now)
        worker.reports += 1   # counted whatever the report's fate (WorkerState.settled)
        req = self.requests.get(msg.request_id)
        if req is not None and req.producer_id == worker.worker_id and req.attempts == msg.attempt:
            # The producer of a streamed hand-off failed: its consumer cannot go on without it.
            worker.tasks.discard(msg.request_id)
            self._offer(worker)
            req.producer_id = None
            return self._fail(req, msg.error_type, msg.message, resumable=msg.error_type in RETRYABLE_ERRORS)
        if req is None or req.worker_id != worker.worker_id or req.attempts != msg.attempt:
            if req is None:
                worker.tasks.discard(msg.request_id)
            return []
        worker.tasks.discard(msg.request_id)
        self._offer(worker)
        req.worker_id = None   # the worker already dropped it: no CancelTask back
        if req.streamed:   # a stream's consumer: nothing can be replayed alone; the producer stops too
            return self._fail(req, msg.error_type, msg.message, resumable=msg.error_type in RETRYABLE_ERRORS)
        if msg.error_type not in RETRYABLE_ERRORS:
            return self._fail(req, msg.error_type, msg.message)
        if req.attempts + 1 >= self.config.max_attempts:
            # Recoverable all the same: the client may try again once the connector recovers.
            return self._fail(req, msg.error_type, msg.message,
                              retry_after=max(self.config.retry_after_s, self._backoff_delay(req.attempts + 1)))
        delay = self._backoff_delay(req.attempts + 1) if msg.error_type in BACKOFF_ERRORS else 0.0
        if delay and now + delay >= req.spec.deadline:
            # Waiting would end past the deadline: say so now instead of holding the request until then.
            return self._fail(req, DeadlineExceeded.error_type, f"{msg.message}; no time is left before the deadline "
                                                        f"to retry after {delay:g}s")
        # Start over from the first stage: the inputs that failed to transfer are gone.
        req.attempts += 1
        req.stage_index, req.inputs = 0, req.spec.inputs
        self.counters["request_restarts"] += 1
        if not delay:
            req.phase = QUEUED
            return self._enqueue(req)
        req.phase, req.not_before = BACKOFF, now + delay
        heapq.heappush(self._backoff, (req.not_before, next(self._backoff_seq), msg.request_id, req.attempts))
        self.counters["restart_backoffs"] += 1
        return []

    def _backoff_delay(self, attempt: int) -> float:
        """The wait before restart number ``attempt`` (1, 2, …): doubling, capped."""
        config = self.config
        return min(config.retry_backoff_max_s, config.retry_backoff_s * 2.0 ** min(attempt - 1, 32))

    def _end_backoffs(self, now: float) -> list[Outgoing]:
        """Queue again, ahead of newer work, every request whose retry delay is over."""
        heap, out = self._backoff, []
        while heap and heap[0][0] <= now:
            _, _, request_id, attempt = heapq.heappop(heap)
            req = self.requests.get(request_id)
            if req is None or req.phase is not BACKOFF or req.attempts != attempt:
                continue   # cancelled or failed while it waited
            req.phase = QUEUED
            out += self._enqueue(req, front=True)
        return out

    def _enqueue(self, req: RequestState, front: bool = False) -> list[Outgoing]:
        """Queue ``req`` for its current stage (held there while the role's workers are expected
        back), or fail it at once when no worker serves that role. ``front``: it was admitted before
        what is queued now (a restart), so it goes first."""
        model, role = req.spec.model, req.stage
        if not self._serves(model, role):
            return self._fail(req, Unavailable.error_type, f"no live {role} worker for model {model}",
                              retry_after=self.config.retry_after_s)
        queue = self.queues[(model, role)]
        if front:
            queue.appendleft(req.spec.request_id)
        else:
            queue.append(req.spec.request_id)
        self._count_held(model, role)
        return self._pump(model, role)

    # ------------------------------------------------------------------ gateways

    def _on_gateway_hello(self, identity: bytes, msg: p.GatewayHello, now: float) -> list[Outgoing]:
        session = self._gateway_sessions.get(identity)
        if session is None:   # new, or given up (_expire_gateways) and back
            session = self._gateway_sessions[identity] = next(self._sessions)
        self.gateways[identity] = now
        return [(identity, p.HelloAck(self.broker_id, session))]

    def _expire_gateways(self, now: float) -> list[Outgoing]:
        """Requests of a gateway that stopped saying hello have nobody to stream to: drop them.
        Its session ends too: if it was only paused, its next hello gets a new one and it resumes
        what it still streams."""
        out: list[Outgoing] = []
        for identity in [g for g, seen in self.gateways.items() if now - seen > self.config.liveness_s]:
            del self.gateways[identity]
            self._gateway_sessions.pop(identity, None)
            self.counters["gateways_expired"] += 1
            for req in [r for r in self.requests.values() if r.gateway == identity]:
                del self.requests[req.spec.request_id]
                self.counters["gateway_requests_dropped"] += 1
                out += self._release(req)
        return out

    def _reject(self, identity: bytes, msg: p.Submit, error_type: str, message: str,
                retry_after: float = 0.0) -> list[Outgoing]:
        self.counters[f"rejected:{error_type}"] += 1
        return [(identity, p.RequestFailed(msg.request_id, msg.stages[0] if msg.stages else "",
                                           error_type, message, retry_after=retry_after))]

    def _on_submit(self, identity: bytes, msg: p.Submit, now: float) -> list[Outgoing]:
        stages, model = msg.stages, msg.model
        if not stages or len(stages) > MAX_STAGES:
            return self._reject(identity, msg, BadRequest.error_type, f"a request passes 1 to {MAX_STAGES} stages")
        if msg.request_id in self.requests:
            return self._reject(identity, msg, BadRequest.error_type, f"duplicate request_id {msg.request_id}")
        if not math.isfinite(msg.deadline):
            return self._reject(identity, msg, BadRequest.error_type, "deadline must be a finite time")
        if msg.reply_to not in self._good_endpoints:
            # Every worker of the request connects to it: refused here, before any worker sees it.
            if reason := endpoint_error(msg.reply_to):
                return self._reject(identity, msg, BadRequest.error_type, f"reply_to: {reason}")
            if len(self._good_endpoints) >= MAX_GOOD_ENDPOINTS:
                self._good_endpoints.clear()
            self._good_endpoints.add(msg.reply_to)
        pools = self.pools
        for role in stages:
            if (model, role) not in pools and not self.expected.awaited((model, role)):
                return self._reject(identity, msg, Unavailable.error_type, f"no live {role} worker for model {model}",
                                    self.config.retry_after_s)
        queues, bound = self.queues, self.config.max_queue_per_role
        for role in stages:
            # Every stage's queue counts: a slow later role must push back on admission too.
            queue = queues.get((model, role))
            if queue is not None and len(queue) >= bound:
                return self._reject(identity, msg, Overloaded.error_type, f"{role} queue is full",
                                    self.config.retry_after_s)
        # Positional (spec, gateway, stage_index, inputs): the keyword form costs twice as much per
        # Submit. The Submit's maps are shared, not copied (see _on_stage_done).
        self.requests[msg.request_id] = RequestState(msg, identity, 0, msg.inputs)
        self.counters["requests_admitted"] += 1
        queues[(model, stages[0])].append(msg.request_id)
        if (model, stages[0]) not in pools:
            self.counters["requests_held"] += 1
        return self._pump(model, stages[0])

    def _on_cancel(self, identity: bytes, msg: p.Cancel, now: float) -> list[Outgoing]:
        req = self.requests.get(msg.request_id)
        if req is None or req.gateway != identity:   # only the gateway that owns a request may cancel it
            return []
        del self.requests[msg.request_id]
        self.counters["cancellations"] += 1
        return self._release(req)

    def _on_status_query(self, identity: bytes, msg: p.StatusQuery, now: float) -> list[Outgoing]:
        reply = self.status(now)
        return [(identity, msgspec.structs.replace(reply, query_id=msg.query_id))]

    # ------------------------------------------------------------------ dispatch

    def _offer(self, worker: WorkerState) -> None:
        """Enter ``worker``'s current load in its pool's heap (it may be picked while it has credit)."""
        if worker.credits <= 0:
            return
        key = (worker.model, worker.role)
        pool = self.pools.get(key)
        if pool is None or pool.get(worker.worker_id) is not worker:
            return
        heap = self._ready.get(key)
        if heap is None:
            heap = self._ready[key] = []
        heapq.heappush(heap, (len(worker.tasks), -worker.credits, worker.dispatched, next(self._ready_seq), worker))
        if len(heap) > 2 * len(pool) + 64:
            seq = self._ready_seq
            heap[:] = [(len(w.tasks), -w.credits, w.dispatched, next(seq), w) for w in pool.values() if w.credits > 0]
            heapq.heapify(heap)

    def _pick_least(self, key: tuple[str, str], pool: dict[str, WorkerState]) -> WorkerState | None:
        """The least-loaded worker of ``pool`` with credit, left on top of its heap; None if none has credit."""
        heap = self._ready.get(key)
        while heap:
            entry = heap[0]
            worker = entry[4]
            if worker.credits <= 0 or pool.get(worker.worker_id) is not worker:
                heapq.heappop(heap)
            elif entry[0] != len(worker.tasks) or entry[1] != -worker.credits or entry[2] != worker.dispatched:
                heapq.heapreplace(heap, (len(worker.tasks), -worker.credits, worker.dispatched,
                                         next(self._ready_seq), worker))
            else:
                return worker
        return None

    def _pump(self, model: str, role: str) -> list[Outgoing]:
        """Dispatch queued requests of (model, role) while some worker has credit."""
        key = (model, role)
        queue = self.queues.get(key)
        out: list[Outgoing] = []
        pool = self.pools.get(key)
        if not queue or pool is None:
            return out
        requests, slack, now = self.requests, self.config.prefix_load_slack, self._now
        prefix_pool = self._prefix_workers.get(key, 0) > 0
        adapters = self._adapters if self._adapters.active(key) else None
        while queue:
            least = self._pick_least(key, pool)
            if least is None:
                break
            request_id = queue.popleft()
            req = requests.get(request_id)
            if req is None or req.phase is not QUEUED:
                continue  # cancelled or failed while queued
            spec = req.spec
            keys = spec.prefix_hashes
            if len(keys) > MAX_PROMPT_BLOCKS:   # a hint, bounded: no sender makes the broker loop long
                keys = keys[:MAX_PROMPT_BLOCKS]
            if keys and prefix_pool and spec.prefix_block_size > 0:
                # A usable hint: the longest cached prefix may beat the least-loaded worker (a scan of
                # the pool's workers with credit, as only a prefix-caching pool needs).
                candidates = [w for w in pool.values() if w.credits > 0]
                worker, hits = pick_worker(candidates, keys, spec.prefix_block_size, slack)
            else:
                worker, hits = least, 0
            lora = request_adapter(spec) if adapters is not None else ""
            if lora and not hits:
                holder = adapters.pick(key, lora, least)
                if holder is not None:
                    worker = holder
                    if holder is not least:   # routed for its adapter, not by load alone
                        worker.lora_routed += 1
                        self.counters["lora_routed"] += 1
            worker.credits -= 1
            worker.tasks.add(request_id)
            worker.dispatched += 1
            if keys and worker.prefix is not None and worker.block_size == spec.prefix_block_size:
                if hits:
                    worker.prefix_routed += 1
                    self.counters["prefix_routed"] += 1
                    self.counters["prefix_hit_blocks"] += hits
                # It will hold this prompt's blocks once its prefill ran: the next request with
                # the same prefix follows even before a heartbeat says so.
                worker.prefix.add(keys)
            if worker is least:   # its entry is the heap's top: replace it in place
                heap = self._ready[key]
                if worker.credits:
                    heapq.heapreplace(heap, (len(worker.tasks), -worker.credits, worker.dispatched,
                                             next(self._ready_seq), worker))
                else:
                    heapq.heappop(heap)
            else:
                self._offer(worker)
            req.phase, req.worker_id, req.dispatched_at = RUNNING, worker.worker_id, now
            worker.sent += 1   # WorkerState.settled
            if lora:
                self._adapters.dispatched(worker, lora)   # it holds the adapter from now on
            out.append((worker.identity, p.Task(
                request_id=request_id, stage=spec.stages[req.stage_index], model=model,
                prompt_token_ids=spec.prompt_token_ids, params=spec.params, inputs=req.inputs,
                reply_to=spec.reply_to, deadline=spec.deadline, attempt=req.attempts,
                position_offset=spec.position_offset, reply_key=spec.reply_key, traceparent=spec.traceparent,
                priority=spec.priority if self._priority else 0)))
        return out

    def _fail(self, req: RequestState, error_type: str, message: str, *, retry_after: float = 0.0,
              resumable: bool = False) -> list[Outgoing]:
        self.requests.pop(req.spec.request_id, None)
        self.counters[f"failed:{error_type}"] += 1
        out = self._release(req)
        out.append((req.gateway, p.RequestFailed(req.spec.request_id, req.stage, error_type, message,
                                                 retry_after=retry_after, resumable=resumable)))
        return out

    def _release(self, req: RequestState) -> list[Outgoing]:
        """Take ``req`` out of its queue or off its worker (telling the worker to drop it), and off
        the producer still streaming into it."""
        out: list[Outgoing] = []
        producer = self.workers.get(req.producer_id or "")
        if producer is not None:
            producer.tasks.discard(req.spec.request_id)
            self._offer(producer)
            out.append(self._to_worker(producer, p.CancelTask(req.spec.request_id)))
        req.producer_id = None
        if req.stages_done:
            return out
        return out + self._release_stage(req)

    def _release_stage(self, req: RequestState) -> list[Outgoing]:
        if req.phase is BACKOFF:
            return []   # its inputs are the Submit's own, and its heap entry is skipped when due
        queue = self.queues.get((req.spec.model, req.stage))
        if req.phase is QUEUED:
            if queue is not None and req.spec.request_id in queue:
                queue.remove(req.spec.request_id)
            if not req.inputs or req.stage_index == 0:   # the first stage's inputs are inline (Submit.inputs)
                return []
            # Data a finished stage left for this one: any worker of the consuming role can delete it,
            # or, while none is live (held for one expected back), a worker of the producing role.
            consumers = (self.pools.get((req.spec.model, req.stage))
                         or self.pools.get((req.spec.model, req.spec.stages[req.stage_index - 1])))
            if not consumers:
                return []
            consumer = min(consumers.values(), key=lambda w: len(w.tasks))
            return [self._to_worker(consumer, p.CancelTask(req.spec.request_id, inputs=req.inputs))]
        worker = self.workers.get(req.worker_id or "")
        if worker is None:
            return []
        worker.tasks.discard(req.spec.request_id)
        self._offer(worker)
        return [self._to_worker(worker, p.CancelTask(req.spec.request_id))]

    @staticmethod
    def _to_worker(worker: WorkerState, msg: p.CancelTask) -> Outgoing:
        """``msg`` for ``worker``, counted: it is settled only once a heartbeat says it handled it."""
        worker.sent += 1
        return worker.identity, msg

    _handlers = {
        p.Register: _on_register,
        p.Credit: _on_credit,
        p.Heartbeat: _on_heartbeat,
        p.Unregister: _on_unregister,
        p.StageDone: _on_stage_done,
        p.StageFailed: _on_stage_failed,
        p.StageStreaming: _on_stage_streaming,
        p.GatewayHello: _on_gateway_hello,
        p.Submit: _on_submit,
        p.Cancel: _on_cancel,
        p.StatusQuery: _on_status_query,
    }
