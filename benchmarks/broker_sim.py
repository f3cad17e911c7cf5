"""Discrete-event simulation of one broker under a large fleet: the real :class:`BrokerCore`, no sockets.

What runs for real and what is simulated:

* **Real**: the broker's state machine (:class:`~omnirelay.broker.core.BrokerCore`) and the wire codec.
  Every message a simulated peer sends is encoded to its frames (outside the measurement); the
  broker's work is exactly what the daemon does per message: :func:`~omnirelay.broker.protocol.decode`
  of the frames, ``core.on_message``, and ``encode_body`` of every reply, plus the ticks
  (``core.tick``: liveness, deadlines, back-offs). Two clocks measure it:

  - *service time* (what the simulated broker is busy for, so what queues the next message):
    ``time.process_time_ns`` around each message, less the median cost of two back-to-back reads.
    CPU time, not wall time: on a shared host the wall clock counts the time other processes held
    the core. Reading it is a system call here (~2 µs), so this figure is the noisier one;
  - *broker CPU per message* (the figure for capacity): every message and tick the broker handled,
    with its time, is recorded and **replayed** against a fresh ``BrokerCore`` in one tight loop,
    timed with ``time.process_time`` once — the real CPU of the broker's work alone, without the
    simulator's own work in between (which evicts the broker's caches and inflates a per-message
    reading), as the daemon's batched receive pass runs it.

  The socket I/O (libzmq's recv/send calls and its I/O thread) is in neither figure: BENCHMARKS.md
  puts it next to the real daemon's.
* **Simulated**: the clock, the network (a fixed one-way delay), the workers (register, grant
  credit, heartbeat every ``heartbeat_interval_s`` at a random phase, run a stage for a sampled
  service time, answer ``StageDone`` and top their credit up once per completed batch, re-register
  when told to), the failures (a worker goes silent at random, comes back ``--restart-s`` later and
  registers again under the same id, as a restarted process does) and the clients (Poisson arrivals
  of prefill → decode requests, spread over a few gateways that say hello every second; a decode
  the broker reports ``resumable`` is submitted again, as the gateway's resume does).

The broker is one server in simulated time: a message that arrives while it is busy waits, and
handling it takes the CPU time that handling it really took. So the dispatch latency (a Submit's
arrival at the broker → its Task leaving it) and the hand-off latency (a prefill's StageDone
arriving → the decode Task leaving) include the broker's own queueing, and the broker's
utilisation (its CPU time / simulated time) says how close to saturation one process is. The
ceiling is where utilisation reaches 1: offered rate / utilisation.

Usage::

    python benchmarks/broker_sim.py --workers 1000 --rate 10000 --duration 5
    python benchmarks/broker_sim.py --sweep --json        # the workers × rate grid of BENCHMARKS.md

Every loop is bounded by the simulated duration; nothing here opens a socket or starts a process.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import heapq
import itertools
import json
import logging
import random
import statistics
import sys
import time

from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams
from omnirelay.broker.config import BrokerConfig
from omnirelay.broker.core import BrokerCore
from omnirelay.handoffs import KVHandoff

MODEL = "sim-model"
PROMPT = [1000 + 37 * i for i in range(8)]
SAMPLING = TextParams(temperature=0.0, max_tokens=64)


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """
    workers:        fleet size; ``prefill_share`` of it serve prefill, the rest decode.
    rate:           requests per simulated second offered (Poisson).
    duration_s:     simulated seconds of load (then the run drains for ``drain_s``).
    prefill_s / decode_s: mean service time of a stage (exponential, so batches finish spread out).
    prefill_capacity / decode_capacity: credits a worker grants (its batch bound).
    failures_per_s: workers that go silent per simulated second (fleet-wide, at random).
    restart_s:      how long a failed worker stays away before it registers again.
    net_s:          one-way network delay of every message.
    gateways:       how many gateways the requests are spread over.
    """

    workers: int = 1000
    rate: float = 10_000.0
    duration_s: float = 5.0
    drain_s: float = 3.0
    prefill_share: float = 0.3
    prefill_s: float = 0.03
    decode_s: float = 0.6
    prefill_capacity: int = 8
    decode_capacity: int = 64
    failures_per_s: float = 2.0
    restart_s: float = 4.0
    net_s: float = 50e-6
    gateways: int = 8
    seed: int = 0


@dataclasses.dataclass(slots=True)
class SimWorker:
    worker_id: str
    role: str
    capacity: int
    identity: bytes = b""
    generation: int = 0        # bumped when it dies: its pending completions are then void
    alive: bool = True
    owed_credits: int = 0      # completions since the last Credit
    flush_pending: bool = False


# Event kinds (ints: cheaper heap tuples than enums).
ARRIVE_BROKER, WORKER_RECV, GATEWAY_RECV, STAGE_END, CREDIT_FLUSH, HEARTBEAT, SUBMIT, TICK, FAIL, RESTART, HELLO = range(11)


class Simulation:
    def __init__(self, config: SimConfig):
        self.cfg = config
        self.rng = random.Random(config.seed)
        self.core = BrokerCore(BrokerConfig(endpoint="inproc://sim", max_queue_per_role=1_000_000))
        self.events: list[tuple] = []
        self.seq = itertools.count()
        self.busy_until = 0.0
        self.busy_ns = 0             # broker service time (CPU, per message) within the load window
        self.msg_busy_ns: list[int] = []
        self.tick_busy_ns: list[int] = []
        self.window = (0.0, 0.0)     # (start, end) of the offered load, simulated seconds
        self.journal: list[tuple] = []   # (identity, frames, now) per message, (None, None, now) per tick: the replay
        self.messages = 0            # handled by the broker (in) + sent by it (out)
        self.window_messages = 0     # … of which within the load window
        self.dispatch_s: list[float] = []     # Submit arrival → first Task leaves
        self.handoff_s: list[float] = []      # prefill StageDone arrival → decode Task leaves
        self.submitted_at: dict[str, float] = {}
        self.stage_done_at: dict[str, float] = {}
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.workers: dict[bytes, SimWorker] = {}
        self.by_id: dict[str, SimWorker] = {}
        self.request_ids = itertools.count()
        self.overhead_ns = self._timer_overhead()

    @staticmethod
    def _timer_overhead() -> int:
        clock = time.process_time_ns
        samples = []
        for _ in range(2000):
            t0 = clock()
            samples.append(clock() - t0)
        return int(statistics.median(samples))

    # ----------------------------------------------------------------------------- plumbing

    def at(self, t: float, kind: int, *payload) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def send_to_broker(self, t: float, identity: bytes, msg: p.Message) -> None:
        self.at(t + self.cfg.net_s, ARRIVE_BROKER, identity, p.encode(msg))

    def broker_handle(self, t: float, identity: bytes, frames: list[bytes]) -> None:
        start = max(t, self.busy_until)
        self.journal.append((identity, frames, start))
        clock = time.process_time_ns
        t0 = clock()
        msg = p.decode(frames)
        out = self.core.on_message(identity, msg, start)
        bodies = [p.encode_body(m) for _, m in out]
        spent = max(0, clock() - t0 - self.overhead_ns)
        del bodies
        self.msg_busy_ns.append(spent)
        self._emit(start, spent, out, arrived=t, incoming=msg)

    def broker_tick(self, t: float) -> None:
        start = max(t, self.busy_until)
        self.journal.append((None, None, start))
        clock = time.process_time_ns
        t0 = clock()
        out = self.core.tick(start)
        for _, m in out:
            p.encode_body(m)
        spent = max(0, clock() - t0 - self.overhead_ns)
        self.tick_busy_ns.append(spent)
        self._emit(start, spent, out, arrived=t, incoming=None)

    def _emit(self, start: float, spent_ns: int, out: list, arrived: float, incoming) -> None:
        done = start + spent_ns / 1e9
        self.busy_until = done
        if self.window[0] <= start < self.window[1]:
            self.busy_ns += spent_ns
            self.window_messages += (incoming is not None) + len(out)
        self.messages += (incoming is not None) + len(out)
        if isinstance(incoming, p.Submit):
            self.submitted_at.setdefault(incoming.request_id, arrived)
        elif isinstance(incoming, p.StageDone) and incoming.stage == "prefill":
            self.stage_done_at[incoming.request_id] = arrived
        for identity, msg in out:
            if isinstance(msg, p.Task):
                rid = msg.request_id
                if msg.stage == "prefill" and rid in self.submitted_at:
                    self.dispatch_s.append(done - self.submitted_at.pop(rid))
                elif msg.stage == "decode" and rid in self.stage_done_at:
                    self.handoff_s.append(done - self.stage_done_at.pop(rid))
            kind = WORKER_RECV if identity in self.workers else GATEWAY_RECV
            self.at(done + self.cfg.net_s, kind, identity, msg)

    # ----------------------------------------------------------------------------- workers

    def register(self, t: float, worker: SimWorker) -> None:
        worker.identity = f"{worker.worker_id}#{worker.generation}".encode()
        self.workers[worker.identity] = worker
        worker.owed_credits, worker.flush_pending = 0, False
        self.send_to_broker(t, worker.identity, p.Register(worker.worker_id, worker.role, MODEL, worker.capacity,
                                                           pid=1, host="sim"))
        self.send_to_broker(t, worker.identity, p.Credit(worker.worker_id, worker.capacity))

    def worker_recv(self, t: float, identity: bytes, msg: p.Message) -> None:
        worker = self.workers.get(identity)
        if worker is None or not worker.alive:
            return
        if isinstance(msg, p.Task):
            mean = self.cfg.prefill_s if msg.stage == "prefill" else self.cfg.decode_s
            self.at(t + self.rng.expovariate(1.0 / mean), STAGE_END, worker, worker.generation, msg)
        elif isinstance(msg, p.Reregister):
            self.outcomes["reregistered"] += 1
            self.register(t, worker)

    def stage_end(self, t: float, worker: SimWorker, generation: int, task: p.Task) -> None:
        if not worker.alive or worker.generation != generation:
            return
        outputs = KVHandoff(f"kv/{task.request_id}", {"bytes": 1 << 20}, 0) if task.stage == "prefill" else None
        self.send_to_broker(t, worker.identity, p.StageDone(worker.worker_id, task.request_id, task.stage,
                                                            outputs, finished=task.stage == "decode",
                                                            attempt=task.attempt))
        if task.stage == "decode":
            self.outcomes["completed"] += 1
        worker.owed_credits += 1
        if not worker.flush_pending:
            # One Credit per engine step's completions, as a worker tops up after each batch.
            worker.flush_pending = True
            self.at(t + 0.001, CREDIT_FLUSH, worker, generation)

    def credit_flush(self, t: float, worker: SimWorker, generation: int) -> None:
        if not worker.alive or worker.generation != generation:
            return
        worker.flush_pending = False
        if worker.owed_credits:
            self.send_to_broker(t, worker.identity, p.Credit(worker.worker_id, worker.owed_credits))
            worker.owed_credits = 0

    def heartbeat(self, t: float, worker: SimWorker, generation: int) -> None:
        if not worker.alive or worker.generation != generation:
            return
        self.send_to_broker(t, worker.identity, p.Heartbeat(worker.worker_id, running=0, waiting=0))
        self.at(t + self.core.config.heartbeat_interval_s, HEARTBEAT, worker, generation)

    def fail(self, t: float) -> None:
        live = [w for w in self.by_id.values() if w.alive]
        if live:
            worker = self.rng.choice(live)
            worker.alive = False
            worker.generation += 1
            del self.workers[worker.identity]
            self.outcomes["workers_failed"] += 1
            self.at(t + self.cfg.restart_s, RESTART, worker)
        self.at(t + self.rng.expovariate(self.cfg.failures_per_s), FAIL)

    def restart(self, t: float, worker: SimWorker) -> None:
        worker.alive = True
        self.register(t, worker)
        self.at(t + self.rng.random() * self.core.config.heartbeat_interval_s, HEARTBEAT, worker, worker.generation)

    # ----------------------------------------------------------------------------- clients

    def submit(self, t: float, stages: list[str] | None = None, resumed: bool = False) -> None:
        gateway = f"gw{self.rng.randrange(self.cfg.gateways)}".encode()
        rid = f"r{next(self.request_ids)}"
        stages = stages or ["prefill", "decode"]
        self.send_to_broker(t, gateway, p.Submit(rid, MODEL, stages, PROMPT, SAMPLING, deadline=t + 120.0,
                                                 reply_to="tcp://127.0.0.1:7001"))
        self.outcomes["resubmitted" if resumed else "submitted"] += 1

    def gateway_recv(self, t: float, identity: bytes, msg: p.Message) -> None:
        if isinstance(msg, p.RequestFailed):
            self.submitted_at.pop(msg.request_id, None)
            self.stage_done_at.pop(msg.request_id, None)
            if msg.resumable:
                self.submit(t, ["decode"], resumed=True)   # the gateway resumes the stream elsewhere
            else:
                self.outcomes[f"failed:{msg.error_type}"] += 1

    # ----------------------------------------------------------------------------- run

    def run(self) -> dict:
        cfg, rng = self.cfg, self.rng
        n_prefill = max(1, round(cfg.workers * cfg.prefill_share))
        for i in range(cfg.workers):
            role = "prefill" if i < n_prefill else "decode"
            worker = SimWorker(f"{role}-{i}", role, cfg.prefill_capacity if role == "prefill" else cfg.decode_capacity)
            self.by_id[worker.worker_id] = worker
            # Fleet start-up spread over the first half second, as a rollout would.
            t0 = rng.random() * 0.5
            self.register(t0, worker)
            self.at(t0 + rng.random() * self.core.config.heartbeat_interval_s, HEARTBEAT, worker, 0)
        for g in range(cfg.gateways):
            self.at(0.0, HELLO, f"gw{g}".encode())
        warmup = 1.0
        load_end, end = warmup + cfg.duration_s, warmup + cfg.duration_s + cfg.drain_s
        self.window = (warmup, load_end)
        self.at(warmup, SUBMIT)
        self.at(0.0, TICK)
        if cfg.failures_per_s > 0:
            self.at(warmup + rng.expovariate(cfg.failures_per_s), FAIL)
        tick_s = self.core.config.heartbeat_interval_s / 2
        events, pop = self.events, heapq.heappop
        gc_was = gc.isenabled()
        gc.collect()
        gc.disable()   # the broker daemon runs with a raised GC threshold; the simulator's own garbage is not its cost
        wall0 = time.monotonic()
        try:
            while events:
                t, _, kind, payload = pop(events)
                if t > end:
                    break
                if kind == ARRIVE_BROKER:
                    self.broker_handle(t, *payload)
                elif kind == WORKER_RECV:
                    self.worker_recv(t, *payload)
                elif kind == STAGE_END:
                    self.stage_end(t, *payload)
                elif kind == CREDIT_FLUSH:
                    self.credit_flush(t, *payload)
                elif kind == GATEWAY_RECV:
                    self.gateway_recv(t, *payload)
                elif kind == HEARTBEAT:
                    self.heartbeat(t, *payload)
                elif kind == SUBMIT:
                    if t < load_end:
                        self.submit(t)
                        self.at(t + rng.expovariate(cfg.rate), SUBMIT)
                elif kind == TICK:
                    self.broker_tick(t)
                    self.at(t + tick_s, TICK)
                elif kind == HELLO:
                    self.send_to_broker(t, payload[0], p.GatewayHello(payload[0].decode()))
                    self.at(t + 1.0, HELLO, payload[0])
                elif kind == FAIL:
                    if t < load_end:
                        self.fail(t)
                elif kind == RESTART:
                    self.restart(t, *payload)
        finally:
            if gc_was:
                gc.enable()
        return self.report(end, time.monotonic() - wall0)

    def replay_cpu(self) -> tuple[float, float]:
        """Broker CPU seconds of the whole run and of the load window, replayed on a fresh core."""
        core = BrokerCore(self.core.config)
        decode, encode_body, on_message, tick = p.decode, p.encode_body, core.on_message, core.tick
        lo, hi = self.window
        cpu = time.process_time
        gc.collect()
        gc.disable()
        try:
            t0 = cpu()
            marks = []
            for identity, frames, now in self.journal:
                if not marks and now >= lo or len(marks) == 1 and now >= hi:
                    marks.append(cpu())
                out = tick(now) if identity is None else on_message(identity, decode(frames), now)
                for _, msg in out:
                    encode_body(msg)
            t1 = cpu()
        finally:
            gc.enable()
        marks += [t1] * (2 - len(marks))
        return t1 - t0, marks[1] - marks[0]

    def report(self, end: float, wall_s: float) -> dict:
        cfg = self.cfg
        total_cpu_s, window_cpu_s = self.replay_cpu()
        load_s = self.window[1] - self.window[0]
        counters = self.core.counters
        busy = self.msg_busy_ns
        return {
            "workers": cfg.workers, "offered_rate": cfg.rate, "load_s": load_s, "simulated_s": round(end, 3),
            "wall_s": round(wall_s, 1),
            "requests_submitted": self.outcomes["submitted"], "requests_completed": self.outcomes["completed"],
            "requests_in_flight_at_end": len(self.core.requests),
            "resumed_after_worker_loss": self.outcomes["resubmitted"],
            "failed": {k.split(":", 1)[1]: v for k, v in self.outcomes.items() if k.startswith("failed:")},
            "workers_failed": self.outcomes["workers_failed"], "reregistrations": counters["registrations"] - cfg.workers,
            "workers_expired": counters["workers_expired"],
            "broker_messages": self.messages,
            "msgs_per_request": round(self.messages / max(1, self.outcomes["submitted"]), 2),
            # CPU replayed in one loop (the capacity figure) and per-message service time (what the simulated queue saw)
            "cpu_us_per_msg": round(total_cpu_s * 1e6 / max(1, self.messages), 2),
            "service_us_per_msg": round(statistics.fmean(busy) / 1e3, 2) if busy else None,
            "service_us_per_msg_p99": round(_pct(busy, 0.99) / 1e3, 2) if busy else None,
            "tick_ms_mean": round(statistics.fmean(self.tick_busy_ns) / 1e6, 3) if self.tick_busy_ns else None,
            "tick_ms_max": round(max(self.tick_busy_ns) / 1e6, 3) if self.tick_busy_ns else None,
            "broker_cpu_utilisation": round(window_cpu_s / load_s, 3),
            "broker_busy_utilisation": round(self.busy_ns / 1e9 / load_s, 3),
            "ceiling_requests_per_s": round(cfg.rate * load_s / window_cpu_s) if window_cpu_s else None,
            "dispatch_ms": _pcts_ms(self.dispatch_s),
            "handoff_ms": _pcts_ms(self.handoff_s),
        }


def _pct(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _pcts_ms(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "p999": pick(0.999), "max": round(ordered[-1] * 1e3, 3)}


SWEEP_WORKERS = (250, 1000)
SWEEP_RATES = (2500, 5000, 7500, 10_000, 12_500)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = SimConfig()
    for field in dataclasses.fields(SimConfig):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, dest=field.name, type=type(getattr(defaults, field.name)),
                            default=getattr(defaults, field.name))
    parser.add_argument("--sweep", action="store_true", help="run the workers × rate grid")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.getLogger("omnirelay.broker").setLevel(logging.ERROR)   # thousands of expected failures
    base = SimConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)})
    grid = ([(w, r) for w in SWEEP_WORKERS for r in SWEEP_RATES] if args.sweep else [(base.workers, base.rate)])
    results = []
    for workers, rate in grid:
        result = Simulation(dataclasses.replace(base, workers=workers, rate=rate)).run()
        results.append(result)
        if not args.json:
            d, h = result["dispatch_ms"], result["handoff_ms"]
            print(f"workers={workers:5d} rate={rate:7.0f}/s  cpu util={result['broker_cpu_utilisation']:.2f} "
                  f"(busy {result['broker_busy_utilisation']:.2f})  cpu/msg={result['cpu_us_per_msg']:.1f}us  "
                  f"service/msg={result['service_us_per_msg']:.1f}us  dispatch p50/p99/p999="
                  f"{d.get('p50')}/{d.get('p99')}/{d.get('p999')} ms  handoff p99={h.get('p99')} ms  "
                  f"ceiling≈{result['ceiling_requests_per_s']}/s  tick max={result['tick_ms_max']} ms  "
                  f"failed={result['failed']}  (wall {result['wall_s']}s)", flush=True)
    if args.json:
        json.dump(results if args.sweep else results[0], sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
