"""Per-request CPU cost of tracing (issue #30): the code each daemon runs for one prefill → decode
request, with tracing off and on, in paired rounds, in one process and without sockets.

What runs, per request, exactly as the daemons call it:

* gateway: the request's span (``Tracing.start`` from the client's traceparent, ``traceparent()``
  for the Submit, the attributes ``finish`` sets, ``end``);
* broker: the real :class:`~omnirelay.broker.core.BrokerCore` with one prefill and one decode
  worker, fed Submit, StageDone (prefill), Credit, StageDone (decode), Credit, with the daemon's
  hook calls (:class:`~omnirelay.broker.tracing_hook.BrokerTracer` ``inbound`` / ``after_pass``)
  and every reply encoded as the daemon's ``_send`` does;
* workers: :class:`~omnirelay.workers.runtime.tracing_hook.WorkerTracer` per task (one step each).

Arms:

* ``off``: no tracer anywhere (the daemons hold None; what ships by default);
* ``unsampled``: every daemon has a tracer, the request carries no traceparent (the gateway's
  sampler said no): the broker's hook looks the request up and moves on;
* ``on``: ratio 1.0, every request traced: 6 spans (gateway, broker, two stages, two workers),
  exported over OTLP/HTTP to a sink in another process. The exporter's thread runs in this process,
  and the round flushes it every :data:`FLUSH_EVERY` requests and at its end, so its CPU (protobuf
  encoding, the HTTP posts) is counted and no span is dropped.

CPU time (``time.process_time``) per round of ``--requests`` requests, rounds in rotating order;
the report gives each arm's median µs per request and the paired ratios to ``off`` (geometric
mean of the rounds' ratios). Socket I/O of the bus is in no arm (the same bytes in all three, but
for the ``traceparent`` strings: 55 bytes in Submit and in each Task, counted separately).

Usage::

    python benchmarks/tracing_overhead.py --requests 2000 --rounds 12
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time

from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams
from omnirelay.broker.config import BrokerConfig
from omnirelay.broker.core import BrokerCore
from omnirelay.broker.tracing_hook import BrokerTracer
from omnirelay.tracing import Tracing
from omnirelay.workers.runtime.tracing_hook import WorkerTracer

SINK = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""
# Flush the exporter every this many requests: 6 spans each stay under the SDK's span queue (2048),
# which a tight loop would otherwise overflow (dropped spans would go uncounted).
FLUSH_EVERY = 200
CLIENT_TRACEPARENT = "00-" + "4bf92f3577b34da6a3ce929d0e0e4736" + "-" + "00f067aa0ba902b7" + "-01"


class Pipeline:
    """One arm: a broker core with a prefill and a decode worker, and the tracers of that arm."""

    def __init__(self, tracing: Tracing | None, sampled: bool):
        self.tracing, self.sampled = tracing, sampled
        self.core = BrokerCore(BrokerConfig(endpoint="inproc://bench", max_queue_per_role=1_000_000))
        self.broker_tracer = BrokerTracer(tracing) if tracing else None
        self.worker_tracers = {role: WorkerTracer(tracing, role, role) for role in ("prefill", "decode")} \
            if tracing else {}
        self.ids = {}
        for role in ("prefill", "decode"):
            identity = role.encode()
            self.ids[identity] = role
            self._broker(identity, p.Register(worker_id=role, role=role, model="m", capacity=1 << 20))
            self._broker(identity, p.Credit(role, 1 << 20))
        self._broker(b"gw", p.GatewayHello("gw"))
        self.n = 0

    def _broker(self, identity: bytes, msg: p.Message) -> list:
        """What the daemon does with one inbound message: hook, core, hook, encode the replies."""
        tracer = self.broker_tracer
        if tracer is not None:
            tracer.inbound(msg)
        out = self.core.on_message(identity, msg, time.time())
        if tracer is not None:
            out = tracer.after_pass(out, self.core)
        for _, reply in out:
            p.encode_body(reply)
        return out

    def request(self) -> None:
        self.n += 1
        request_id = f"r{self.n}"
        span = traceparent = None
        if self.tracing is not None:   # the gateway's request record
            span = self.tracing.start("POST /v1/chat/completions", CLIENT_TRACEPARENT if self.sampled else "",
                                      kind="server", attributes={"http.route": "/v1/chat/completions", "model": "m",
                                                                 "omnirelay.request_id": request_id})
            traceparent = self.tracing.traceparent(span)   # "" when the sampler said no
        submit = p.Submit(request_id=request_id, model="m", stages=["prefill", "decode"], prompt_token_ids=[1] * 16,
                          params=TextParams(max_tokens=16), deadline=time.time() + 60, reply_to="tcp://127.0.0.1:1",
                          traceparent=traceparent or "")
        p.encode_body(submit)
        tasks = self._broker(b"gw", submit)
        for role in ("prefill", "decode"):
            (_, task), = [(i, m) for i, m in tasks if isinstance(m, p.Task)]
            worker = self.worker_tracers.get(role)
            if worker is not None and task.traceparent:
                worker.task_started(task)
            done = p.StageDone(worker_id=role, request_id=request_id, stage=role, finished=role == "decode")
            if worker is not None:   # the loop: the step's outputs, then their sending
                worker.stepped([(b"", done)])
                worker.reported(done)
            tasks = self._broker(role.encode(), done)
            self._broker(role.encode(), p.Credit(role, 1))
        if span is not None:
            for key, value in (("outcome", "ok"), ("http.status_code", 200), ("prompt_tokens", 16),
                               ("completion_tokens", 16), ("resumes", 0)):
                span.set_attribute(key, value)
            span.end()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    sink = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{sink.stdout.readline().strip()}/v1/traces"
        tracing, never = Tracing("bench", url, ratio=1.0), Tracing("bench", url, ratio=0.0)
        arms = {"off": Pipeline(None, False), "unsampled": Pipeline(never, False), "on": Pipeline(tracing, True)}
        for arm in arms.values():   # warm up: caches, imports, the exporter's connection
            for _ in range(200):
                arm.request()
        tracing.flush()
        per_request: dict[str, list[float]] = {name: [] for name in arms}
        order = list(arms)
        for r in range(args.rounds):
            for name in order[r % 3:] + order[:r % 3]:
                arm = arms[name]
                start = time.process_time()
                for i in range(args.requests):
                    arm.request()
                    if arm.tracing is not None and i % FLUSH_EVERY == FLUSH_EVERY - 1:
                        arm.tracing.flush()   # the exporter's work for these spans, inside the round
                if arm.tracing is not None:
                    arm.tracing.flush()
                per_request[name].append((time.process_time() - start) / args.requests * 1e6)
        tracing.shutdown()
        never.shutdown()
    finally:
        sink.kill()
        sink.wait()
    off = per_request["off"]
    print(f"{args.rounds} rounds x {args.requests} requests (prefill -> decode), CPU µs per request")
    for name, values in per_request.items():
        ratios = [v / o for v, o in zip(values, off)]
        gmean = math.exp(statistics.fmean(math.log(x) for x in ratios))
        spread = statistics.stdev(math.log(x) for x in ratios) if len(ratios) > 1 else 0.0
        half = 2.2 * spread / math.sqrt(len(ratios))   # ~95 % t interval for 12 rounds, in log space
        print(f"  {name:10s} median {statistics.median(values):7.1f} µs   vs off {gmean:.3f}x "
              f"(95% {math.exp(math.log(gmean) - half):.3f}-{math.exp(math.log(gmean) + half):.3f})")
    extra = len(CLIENT_TRACEPARENT)
    print(f"  wire: +{extra} bytes in the Submit and in each Task when traced, 0 when not")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
