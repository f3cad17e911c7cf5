"""The measurements of ``benchmarks/connectors.py`` (not a benchmark script of its own): the
in-process copy references, raw TCP, and a producer → consumer put+get between two
``connector_child.py`` processes. Each returns GB/s of its fastest iteration (the host is shared:
the minimum is the stable estimate); ``measure_pair`` also the put / get split and the median.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

MIB = 1 << 20
CHILD = Path(__file__).resolve().parent / "connector_child.py"


class Child:
    """A ``connector_child.py`` process, spoken to in JSON lines; ``hello`` is its ready line."""

    def __init__(self, role: str, kind: str, options: dict, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, str(CHILD), role, kind, json.dumps(options)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "GLOG_minloglevel": "2", **(env or {})})
        self.hello = self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark child exited with {self.proc.wait()}")
        return json.loads(line)

    def call(self, cmd: dict) -> dict:
        self.send(cmd)
        return self.read()

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


def measure_memcpy(size: int, iters: int) -> float:
    import torch
    torch.set_num_threads(1)
    src, dst = torch.ones(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return size / min(times) / 1e9


def measure_memcpy_cold(size: int, iters: int) -> float:
    import torch
    torch.set_num_threads(1)
    src, dst = torch.ones(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
    scratch = torch.zeros(256 * MIB, dtype=torch.uint8)
    times = []
    for i in range(iters):
        scratch.fill_(i)   # push src and dst out of the caches
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return size / min(times) / 1e9


def measure_tcp(size: int, iters: int, warmup: int) -> float:
    receiver = Child("consumer", "tcp", {})
    sender = Child("producer", "tcp", {})
    try:
        sender.call({"op": "connect", "port": receiver.hello["ready"]})
        times = []
        for i in range(warmup + iters):
            receiver.send({"op": "recv", "size": size})
            time.sleep(0.002)   # the receiver is blocked in recv_into before the first byte leaves
            t0 = sender.call({"op": "send", "size": size})["t0"]
            t1 = receiver.read()["t1"]
            if i >= warmup:
                times.append(t1 - t0)
        return size / min(times) / 1e9
    finally:
        sender.close()
        receiver.close()


def measure_pair(kind: str, options: dict, size: int, iters: int, warmup: int, touch: bool = False,
                 in_place: bool = False) -> dict:
    producer = Child("producer", kind, options)
    consumer = Child("consumer", kind, options)
    try:
        pairs = []
        for i in range(warmup + iters):
            key = f"bench/{uuid.uuid4().hex[:8]}"
            put = producer.call({"op": "put", "key": key, "size": size, "in_place": in_place})
            got = consumer.call({"op": "get", "key": key, "size": size, "handle": put["handle"], "touch": touch})
            if i >= warmup:
                pairs.append((put["dt"] + got["dt"], put["dt"], got["dt"]))
        best, put_s, get_s = min(pairs)
        median = statistics.median(p[0] for p in pairs)
        return {"gbps": size / best / 1e9, "median_gbps": size / median / 1e9, "put_ms": put_s * 1e3,
                "get_ms": get_s * 1e3}
    finally:
        producer.close()
        consumer.close()
