"""Broker benchmark: one broker hop against a raw ZeroMQ round trip, side by side in one run.

What is measured (each repeat starts fresh processes; the summary is the median over repeats):

* **raw**: a DEALER client and a ROUTER echo server in its own process (pinned to the same core the
  broker gets) exchange the exact frames of a typical :class:`~omnirelay.broker.protocol.Submit`
  (``[version, tag, body]``, body ~200 bytes). Latency: one message in flight, p50/p99 of the round
  trip client → server → client. Throughput: ``--window`` messages in flight for ``--duration``
  seconds; round trips per second and server messages per second (one in + one out per round trip).
* **broker hop**: a real ``omni-broker`` process (pinned to one core), a gateway DEALER and a worker
  DEALER that registered for the role and holds credit. Latency: p50/p99 of Submit sent by the
  gateway → Task arrived at the worker (gateway → broker → worker: two socket hops, like the raw
  round trip); after each sample the worker answers ``StageDone(finished)`` + ``Credit(1)`` and
  syncs with a StatusQuery so the next sample starts on an idle broker. Throughput: ``--window``
  requests in flight for ``--duration`` seconds; the worker answers every Task with StageDone and
  tops its credit up after each batch it drains. Reported: requests dispatched per second and
  messages the broker routed per second (every message it received or sent: Submit, Task,
  StageDone, Credit, and any rejection), plus the broker's CPU use over the window, the share of
  that CPU spent in its main (Python) thread rather than libzmq's I/O thread, and its context
  switches per message (wake-ups of either thread).

The client (gateway + worker, or the raw client) runs in this process on the other core(s); on its
side of the hot loop it calls pyzmq's compiled socket directly and decodes only the Task fields it
echoes, so that the broker, not the client, is what saturates (the broker's CPU share in the output
says whether it did). "Messages per CPU-second" divides by the broker process's own CPU time (both
its threads: Python and libzmq's I/O thread), i.e. what one whole core would route. It is steadier
than the wall-clock rate on a shared machine, but not load-proof: a busy sibling hyper-thread or a
cold cache makes every CPU-second do less, so compare revisions in the same run (``--baseline-module``).

Goals (issue 3): hop p50 ≤ 2 × raw round trip p50; the broker routes ≥ 50k messages per second on
one core (messages per broker CPU-second).

Usage::

    python benchmarks/broker.py                 # 3 repeats, table
    python benchmarks/broker.py --json          # the same as JSON on stdout
    python benchmarks/broker.py --profile broker.prof   # one broker throughput run under cProfile
    # this checkout's broker against another revision's (here HEAD: the committed broker against
    # the working tree's), side by side in every repeat; the baseline's package gets its own name:
    git worktree add --detach /tmp/omni-base HEAD
    mkdir -p /tmp/omni-basepkg && ln -s /tmp/omni-base/broker /tmp/omni-basepkg/h5base
    PYTHONPATH=/tmp/omni-basepkg python benchmarks/broker.py --baseline-module h5base.daemon --repeat 5
    rm -r /tmp/omni-basepkg && git worktree remove /tmp/omni-base

Every child process is started and stopped by PID (SIGTERM, wait, SIGKILL); every loop is bounded
by a count and a deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import msgspec
import zmq

from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams

MODEL = "bench-model"
ROLE = "prefill"
WORKER_ID = "bench-w1"
PROMPT = [1000 + 37 * i for i in range(8)]         # 8 three-byte tokens: a ~230-byte Submit body
SAMPLING = TextParams(temperature=0.0, max_tokens=64, top_p=1.0)
REPLY_TO = "tcp://127.0.0.1:7001"
WORKER_CAPACITY = 4096


# ------------------------------------------------------------------------------------ processes


class Child:
    """One child process, started in its own session and stopped by its PID."""

    def __init__(self, argv: list[str], log_path: str, cpu: int | None):
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        self.pinned = False
        if cpu is not None:
            try:
                os.sched_setaffinity(self.pid, {cpu})
                self.pinned = True
            except OSError:
                pass

    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu_seconds(self) -> float:
        """user + system CPU time of the process so far (from /proc)."""
        with open(f"/proc/{self.pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def context_switches(self) -> int:
        """Voluntary + involuntary context switches of all the process's threads so far (for the
        broker: mostly libzmq's I/O thread woken to move a few messages, and the loop preempted by it)."""
        total = 0
        for tid in os.listdir(f"/proc/{self.pid}/task"):
            try:
                with open(f"/proc/{self.pid}/task/{tid}/status") as handle:
                    total += sum(int(line.split()[1]) for line in handle if "ctxt_switches" in line)
            except OSError:   # a thread that ended meanwhile
                pass
        return total

    def main_thread_cpu_seconds(self) -> float:
        """The same for the process's main thread only (for the broker: Python, without libzmq's I/O thread)."""
        with open(f"/proc/{self.pid}/task/{self.pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, timeout_s: float = 5.0) -> int | None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout_s)
        return self.proc.returncode

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path) as handle:
                return handle.read()[-n:]
        except OSError:
            return ""


def echo_server(endpoint: str) -> int:
    """The raw baseline's server: a ROUTER that sends every message straight back (``--echo-server``)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.bind(endpoint)
    print("echo ready", flush=True)
    while True:   # ended by SIGTERM from the benchmark (default disposition: the process exits)
        sock.send_multipart(sock.recv_multipart(copy=True), copy=True)


def cpu_plan(broker_cpu: int) -> tuple[int | None, set[int] | None]:
    """(core for the server process, cores for this client) — or no pinning on a 1-core affinity."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:
        return None, None
    if len(allowed) < 2 or broker_cpu not in allowed:
        return None, None
    return broker_cpu, allowed - {broker_cpu}


# ------------------------------------------------------------------------------------ helpers


def dealer(ctx: zmq.Context, endpoint: str, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.connect(endpoint)
    return sock


def recv_within(sock: zmq.Socket, timeout_s: float) -> list[bytes]:
    if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
        raise TimeoutError("no message within %.1f s" % timeout_s)
    return sock.recv_multipart()


def percentiles(samples_ns: list[int]) -> dict:
    ordered = sorted(samples_ns)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0   # noqa: E731
    return {"p50_us": pick(0.50), "p99_us": pick(0.99), "mean_us": statistics.fmean(ordered) / 1000.0,
            "samples": len(ordered)}


def submit_frames(request_id: str, deadline: float) -> list[bytes]:
    return p.encode(p.Submit(request_id, MODEL, [ROLE], PROMPT, SAMPLING, deadline, REPLY_TO))


class _TaskHead(msgspec.Struct):
    """The three Task fields the benchmark's worker echoes (msgspec skips the others)."""

    request_id: str
    stage: str
    attempt: int = 0


_send_frame = zmq.backend.Socket.send
_recv_frame = zmq.backend.Socket.recv
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)


def send3(sock: zmq.Socket, frames: list[bytes]) -> None:
    """``send_multipart`` through pyzmq's compiled socket: the client must outrun the broker."""
    _send_frame(sock, frames[0], _SNDMORE)
    _send_frame(sock, frames[1], _SNDMORE)
    _send_frame(sock, frames[2], 0)


def recv3(sock: zmq.Socket) -> list[bytes] | None:
    """One ``[version, tag, body]`` message from the broker (which always sends three frames), or
    None when none is waiting."""
    try:
        version = _recv_frame(sock, _NOBLOCK, True)
    except zmq.Again:
        return None
    return [version, _recv_frame(sock, 0, True), _recv_frame(sock, 0, True)]


# ------------------------------------------------------------------------------------ raw baseline


def run_raw(args, workdir: str, server_cpu: int | None) -> dict:
    endpoint = f"ipc://{workdir}/echo.sock"
    server = Child([sys.executable, os.path.abspath(__file__), "--echo-server", endpoint],
                   os.path.join(workdir, "echo.log"), server_cpu)
    ctx = zmq.Context()
    sock = dealer(ctx, endpoint)
    frames = submit_frames("req-raw", time.time() + 3600)
    try:
        deadline = time.monotonic() + 20
        while True:   # wait for the server: ping until it echoes
            sock.send_multipart(frames)
            if sock.poll(200, zmq.POLLIN):
                sock.recv_multipart()
                break
            if time.monotonic() > deadline or not server.alive():
                raise RuntimeError("echo server did not start:\n" + server.log_tail())
        while sock.poll(100, zmq.POLLIN):   # late echoes of extra pings
            sock.recv_multipart()

        samples = []
        for i in range(args.warmup + args.latency_iters):
            t0 = time.perf_counter_ns()
            sock.send_multipart(frames)
            recv_within(sock, 5.0)
            if i >= args.warmup:
                samples.append(time.perf_counter_ns() - t0)
        latency = percentiles(samples)

        cpu0 = server.cpu_seconds()
        sent = received = 0
        t0 = time.perf_counter()
        stop_at = t0 + args.duration
        hard_stop = stop_at + 10
        while True:
            now = time.perf_counter()
            if now < stop_at:
                while sent - received < args.window:
                    send3(sock, frames)
                    sent += 1
            elif received >= sent or now > hard_stop:
                break
            if sock.poll(50, zmq.POLLIN):
                for _ in range(4096):
                    if recv3(sock) is None:
                        break
                    received += 1
        elapsed = time.perf_counter() - t0
        cpu = server.cpu_seconds() - cpu0
        return {"body_bytes": len(frames[2]), "frames": len(frames), **latency,
                "round_trips_per_s": received / elapsed, "server_msgs_per_s": 2 * received / elapsed,
                "server_cpu_pct": 100.0 * cpu / elapsed, "server_msgs_per_cpu_s": 2 * received / max(cpu, 1e-9),
                "lost": sent - received, "pinned": server.pinned}
    finally:
        sock.close(0)
        ctx.term()
        server.stop()


# ------------------------------------------------------------------------------------ broker hop


def start_broker(args, workdir: str, endpoint: str, cpu: int | None, profile: str | None, module: str) -> Child:
    argv = [sys.executable]
    if profile:
        argv += ["-m", "cProfile", "-o", profile]
    argv += ["-m", module, "--endpoint", endpoint, "--log-level", "WARNING",
             "--max-queue-per-role", str(max(1024, 4 * args.window))]
    return Child(argv, os.path.join(workdir, "broker.log"), cpu)


def run_broker(args, workdir: str, broker_cpu: int | None, profile: str | None = None,
               module: str = "omnirelay.broker.daemon") -> dict:
    endpoint = f"ipc://{workdir}/broker.sock"
    broker = start_broker(args, workdir, endpoint, broker_cpu, profile, module)
    ctx = zmq.Context()
    gw = dealer(ctx, endpoint, b"bench-gw")
    worker = dealer(ctx, endpoint, WORKER_ID.encode())
    far = time.time() + 3600
    try:
        deadline = time.monotonic() + 30
        query = 0
        while True:   # wait for the broker: StatusQuery until it answers
            query += 1
            gw.send_multipart(p.encode(p.StatusQuery(query)))
            if gw.poll(250, zmq.POLLIN):
                break
            if time.monotonic() > deadline or not broker.alive():
                raise RuntimeError("broker did not start:\n" + broker.log_tail())
        while gw.poll(100, zmq.POLLIN):
            gw.recv_multipart()

        worker.send_multipart(p.encode(p.Register(WORKER_ID, ROLE, MODEL, WORKER_CAPACITY, pid=os.getpid())))
        worker.send_multipart(p.encode(p.Credit(WORKER_ID, WORKER_CAPACITY)))
        worker.send_multipart(p.encode(p.StatusQuery(1)))
        status = p.decode(recv_within(worker, 10.0))
        assert isinstance(status, p.StatusReply) and status.workers, f"worker did not register: {status}"

        # -- latency: one request at a time
        samples = []
        for i in range(args.warmup + args.latency_iters):
            rid = f"lat-{i:08d}"
            frames = submit_frames(rid, far)
            t0 = time.perf_counter_ns()
            gw.send_multipart(frames)
            task = recv_within(worker, 5.0)
            t1 = time.perf_counter_ns()
            if task[1] != p.Task.TAG:
                raise RuntimeError(f"expected a Task, got {task[1]!r}")
            if i >= args.warmup:
                samples.append(t1 - t0)
            worker.send_multipart(p.encode(p.StageDone(WORKER_ID, rid, ROLE, finished=True)))
            worker.send_multipart(p.encode(p.Credit(WORKER_ID, 1)))
            worker.send_multipart(p.encode(p.StatusQuery(i)))
            if recv_within(worker, 5.0)[1] != p.StatusReply.TAG:
                raise RuntimeError("expected a StatusReply")
        latency = percentiles(samples)

        # -- throughput: many in flight, credits topped up after every drained batch
        poller = zmq.Poller()
        poller.register(gw, zmq.POLLIN)
        poller.register(worker, zmq.POLLIN)
        task_head = msgspec.msgpack.Decoder(_TaskHead)
        pack = msgspec.msgpack.Encoder().encode
        submitted = dispatched = rejected = dones = credits = 0
        cpu0, main0, switches0 = broker.cpu_seconds(), broker.main_thread_cpu_seconds(), broker.context_switches()
        t0 = time.perf_counter()
        stop_at = t0 + args.duration
        hard_stop = stop_at + 10
        last_task_at = t0
        while True:
            now = time.perf_counter()
            if now < stop_at:
                while submitted - dispatched - rejected < args.window:
                    send3(gw, submit_frames(f"tp-{submitted:09d}", far))
                    submitted += 1
            elif dispatched + rejected >= submitted or now > hard_stop:
                break
            events = dict(poller.poll(50))
            if worker in events:
                batch = 0
                for _ in range(4096):
                    frames = recv3(worker)
                    if frames is None:
                        break
                    if frames[1] != p.Task.TAG:
                        continue
                    task = task_head.decode(frames[2])
                    send3(worker, [p.VERSION_FRAME, p.StageDone.TAG, pack(
                        {"worker_id": WORKER_ID, "request_id": task.request_id, "stage": task.stage,
                         "finished": True, "attempt": task.attempt})])
                    batch += 1
                if batch:
                    dispatched += batch
                    dones += batch
                    last_task_at = time.perf_counter()
                    send3(worker, p.encode(p.Credit(WORKER_ID, batch)))
                    credits += 1
            if gw in events:
                for _ in range(4096):
                    frames = recv3(gw)
                    if frames is None:
                        break
                    if frames[1] == p.RequestFailed.TAG:
                        rejected += 1
        elapsed = max(1e-9, last_task_at - t0)
        cpu = broker.cpu_seconds() - cpu0
        main_cpu = broker.main_thread_cpu_seconds() - main0
        switches = broker.context_switches() - switches0
        wall = time.perf_counter() - t0
        routed = submitted + dispatched + dones + credits + rejected
        if not broker.alive():
            raise RuntimeError("broker died:\n" + broker.log_tail())
        return {**latency, "requests_per_s": dispatched / elapsed, "broker_msgs_per_s": routed / elapsed,
                "msgs_per_request": routed / max(1, dispatched), "rejected": rejected,
                "lost": submitted - dispatched - rejected, "broker_cpu_pct": 100.0 * cpu / wall,
                "broker_cpu_us_per_msg": 1e6 * cpu / max(1, routed), "broker_msgs_per_cpu_s": routed / max(cpu, 1e-9),
                "requests_per_cpu_s": dispatched / max(cpu, 1e-9),
                "main_thread_cpu_share": main_cpu / max(cpu, 1e-9),
                "context_switches_per_msg": switches / max(1, routed),
                "pinned": broker.pinned}
    except TimeoutError as exc:
        raise RuntimeError(f"{module}: {exc} (broker alive: {broker.alive()}); its log:\n{broker.log_tail()}") from None
    finally:
        gw.close(0)
        worker.close(0)
        ctx.term()
        broker.stop()


# ------------------------------------------------------------------------------------ report


HOP_KEYS = ("p50_us", "p99_us", "requests_per_s", "broker_msgs_per_s", "msgs_per_request", "broker_cpu_pct",
            "broker_cpu_us_per_msg", "broker_msgs_per_cpu_s", "requests_per_cpu_s", "main_thread_cpu_share",
            "context_switches_per_msg")


def summarize(runs: list[dict]) -> dict:
    med = lambda key, part: statistics.median(r[part][key] for r in runs)   # noqa: E731
    raw = {k: med(k, "raw") for k in ("p50_us", "p99_us", "round_trips_per_s", "server_msgs_per_s",
                                       "server_cpu_pct", "server_msgs_per_cpu_s")}
    hop = {k: med(k, "broker") for k in HOP_KEYS}
    goals = {
        "hop_p50_over_raw_p50": hop["p50_us"] / raw["p50_us"],
        "hop_p99_over_raw_p99": hop["p99_us"] / raw["p99_us"],
        "latency_goal_met": hop["p50_us"] <= 2 * raw["p50_us"],
        # One core's capacity: messages per CPU-second of the broker process (the wall-clock rate
        # also depends on how fast this one-process client can feed it, and on the machine's load).
        "throughput_goal_met": hop["broker_msgs_per_cpu_s"] >= 50_000,
    }
    summary = {"raw": raw, "broker": hop, "goals": goals}
    if all("baseline" in r for r in runs):
        summary["baseline"] = {k: med(k, "baseline") for k in HOP_KEYS}
        # Paired per repeat (the two brokers ran back to back under the same load), then the median.
        summary["broker_over_baseline_msgs_per_cpu_s"] = statistics.median(
            r["broker"]["broker_msgs_per_cpu_s"] / r["baseline"]["broker_msgs_per_cpu_s"] for r in runs)
    return summary


def print_table(result: dict) -> None:
    m = result["machine"]
    print(f"machine: {m['cpus']} cores ({m['cpu_model']}), python {m['python']}, pyzmq {m['pyzmq']}, "
          f"libzmq {m['libzmq']}, loadavg before {m['loadavg']}; server pinned to cpu {m['server_cpu']}")
    print(f"message: {result['body_bytes']}-byte msgpack body, 3 frames; {result['config']['repeat']} repeats, "
          f"median shown; window {result['config']['window']}, {result['config']['duration']} s per throughput phase")
    s = result["summary"]
    raw, hop, base = s["raw"], s["broker"], s.get("baseline")
    pair = lambda key, fmt: [fmt.format(hop[key])] + ([fmt.format(base[key])] if base else [])   # noqa: E731
    rows = [
        ("latency p50 (µs)", f"{raw['p50_us']:.1f}", *pair("p50_us", "{:.1f}"),
         f"{s['goals']['hop_p50_over_raw_p50']:.2f}×"),
        ("latency p99 (µs)", f"{raw['p99_us']:.1f}", *pair("p99_us", "{:.1f}"),
         f"{s['goals']['hop_p99_over_raw_p99']:.2f}×"),
        ("round trips / requests per s", f"{raw['round_trips_per_s']:,.0f}", *pair("requests_per_s", "{:,.0f}"), ""),
        ("messages per s at the server", f"{raw['server_msgs_per_s']:,.0f}", *pair("broker_msgs_per_s", "{:,.0f}"),
         f"{hop['broker_msgs_per_s'] / raw['server_msgs_per_s']:.2f}×"),
        ("server CPU over the window (%)", f"{raw['server_cpu_pct']:.0f}", *pair("broker_cpu_pct", "{:.0f}"), ""),
        ("server CPU per message (µs)", f"{1e6 / raw['server_msgs_per_cpu_s']:.1f}",
         *pair("broker_cpu_us_per_msg", "{:.1f}"), ""),
        ("messages per CPU-second (one core's capacity)", f"{raw['server_msgs_per_cpu_s']:,.0f}",
         *pair("broker_msgs_per_cpu_s", "{:,.0f}"),
         f"{hop['broker_msgs_per_cpu_s'] / raw['server_msgs_per_cpu_s']:.2f}×"),
        ("requests per CPU-second", "", *pair("requests_per_cpu_s", "{:,.0f}"), ""),
        ("… of that CPU in the main (Python) thread (%)", "", *pair("main_thread_cpu_share", "{:.0%}"), ""),
        ("broker context switches per message", "", *pair("context_switches_per_msg", "{:.2f}"), ""),
        ("messages per request", "2", *pair("msgs_per_request", "{:.2f}"), ""),
    ]
    header = ("", "raw ZeroMQ", "broker hop") + (("baseline hop",) if base else ()) + ("hop/raw",)
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)))
    g = s["goals"]
    print(f"goal hop p50 ≤ 2× raw p50: {'MET' if g['latency_goal_met'] else 'MISSED'} "
          f"({g['hop_p50_over_raw_p50']:.2f}×); goal ≥ 50k broker msgs per CPU-second: "
          f"{'MET' if g['throughput_goal_met'] else 'MISSED'} ({hop['broker_msgs_per_cpu_s']:,.0f}; "
          f"wall {hop['broker_msgs_per_s']:,.0f}/s)")
    if base:
        print(f"broker / baseline ({result['config']['baseline_module']}), msgs per CPU-second, paired per repeat: "
              f"{s['broker_over_baseline_msgs_per_cpu_s']:.2f}×")
    for i, run in enumerate(result["runs"], 1):
        r = run["raw"]
        line = (f"  run {i}: raw p50 {r['p50_us']:.1f} µs p99 {r['p99_us']:.1f} µs {r['server_msgs_per_s']:,.0f} msg/s "
                f"(server CPU {r['server_cpu_pct']:.0f}%, {r['server_msgs_per_cpu_s']:,.0f} msg per CPU-s)")
        for part in ("broker", "baseline"):
            if part in run:
                b = run[part]
                line += (f" | {'hop' if part == 'broker' else 'baseline'} p50 {b['p50_us']:.1f} µs "
                         f"p99 {b['p99_us']:.1f} µs {b['requests_per_s']:,.0f} req/s {b['broker_msgs_per_s']:,.0f} msg/s "
                         f"(CPU {b['broker_cpu_pct']:.0f}%, main thread {b['main_thread_cpu_share']:.0%}, "
                         f"{b['context_switches_per_msg']:.2f} ctx sw/msg, "
                         f"{b['broker_msgs_per_cpu_s']:,.0f} msg per CPU-s, "
                         f"lost {b['lost']}, rejected {b['rejected']})")
        print(line)


def machine(server_cpu) -> dict:
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), model)
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "loadavg": round(os.getloadavg()[0], 2),
            "server_cpu": server_cpu}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="fresh runs of both phases; the median is reported")
    parser.add_argument("--latency-iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds of each throughput phase")
    parser.add_argument("--window", type=int, default=512, help="messages/requests in flight for throughput")
    parser.add_argument("--broker-cpu", type=int, default=0, help="core the broker (and echo server) is pinned to")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    parser.add_argument("--profile", metavar="PATH",
                        help="run the broker phase once under cProfile, write PATH and print the top functions")
    parser.add_argument("--broker-module", default="omnirelay.broker.daemon",
                        help="module run with `python -m` as the broker (default: this checkout's)")
    parser.add_argument("--baseline-module", metavar="MODULE",
                        help="a second broker module (e.g. an older revision's daemon on PYTHONPATH) measured in "
                             "every repeat right next to --broker-module, alternating which goes first")
    parser.add_argument("--echo-server", metavar="ENDPOINT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo_server:
        return echo_server(args.echo_server)

    server_cpu, client_cpus = cpu_plan(args.broker_cpu)
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)
    info = machine(server_cpu)
    workdir = tempfile.mkdtemp(prefix="omni-bench-broker-")
    try:
        if args.profile:
            run = run_broker(args, workdir, server_cpu, profile=os.path.abspath(args.profile),
                             module=args.broker_module)
            print(json.dumps(run, indent=2))
            import pstats
            stats = pstats.Stats(os.path.abspath(args.profile))
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(30)
            return 0
        runs = []
        for i in range(max(1, args.repeat)):
            run = {"raw": run_raw(args, workdir, server_cpu)}
            order = [("broker", args.broker_module)]
            if args.baseline_module:   # alternate the order so a drift in load favours neither
                order = order + [("baseline", args.baseline_module)] if i % 2 == 0 else \
                    [("baseline", args.baseline_module)] + order
            for part, module in order:
                run[part] = run_broker(args, workdir, server_cpu, module=module)
            runs.append(run)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = {"command": "python benchmarks/broker.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": info, "body_bytes": len(submit_frames("req-00000000", 0.0)[2]),
              "config": {k: getattr(args, k) for k in ("repeat", "latency_iters", "warmup", "duration", "window",
                                                       "broker_cpu", "broker_module", "baseline_module")},
              "runs": runs, "summary": summarize(runs)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
