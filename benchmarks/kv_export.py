"""Whole-KV export, gathered into a tensor and put (a copy) vs gathered in place (reserve → put_reserved).

    python benchmarks/kv_export.py [--kv-mib 1 8 32] [--iters 30] [--backends shared_memory mooncake_transfer_engine]

What one sample measures, in one process: a prefill's hand-off of one sequence's KV from its paged
pool to the connector, as ``PrefillEngine`` does it after the forward, then a consumer connector's
``get`` of it (in this process: the same calls a decode worker makes, without the broker hop), then
``delete``. ``copy`` is the path before in-place puts: ``runner.read_kv`` gathers into a fresh
tensor and ``put`` copies it into the backend's memory. ``in place`` reserves the KV's shape in
connector memory, gathers straight into it and publishes with ``put_reserved``. The pool has the
tiny model's shape (built offline, as the tests do; blocks of 16 tokens) and the sequence's
blocks are scattered through it, as they are after some traffic; ``--kv-mib`` sets the sequence
length. The two paths alternate sample by sample (the host is shared); each cell is the best and
the median over ``--iters`` samples, of export (gather + put) and of export + get.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import torch

from omnirelay.connectors import create_connector
from omnirelay.workers.llm.model_runner import LocalRunner, local_runner
from omnirelay.workers.llm.models.llama import LlamaModel

BLOCK = 16


def export_copy(runner: LocalRunner, connector, key: str, blocks: list[int], n: int):
    kv = runner.read_kv(blocks, n)
    return connector.put(key, {"kv": kv, "num_tokens": n})


def export_in_place(runner: LocalRunner, connector, key: str, blocks: list[int], n: int):
    reservation = connector.reserve({"kv": runner.kv_spec(n)})
    runner.read_kv(blocks, n, out=reservation.tensors["kv"])
    return connector.put_reserved(key, reservation, {"num_tokens": n})


PATHS = {"copy": export_copy, "in place": export_in_place}


def kv_bytes_per_token(runner: LocalRunner) -> int:
    shape, dtype = runner.kv_spec(1)
    return torch.Size(shape).numel() * dtype.itemsize


def measure(producer, consumer, runner, kv_mib: float, iters: int) -> dict:
    n = max(1, int(kv_mib * (1 << 20)) // kv_bytes_per_token(runner))
    g = torch.Generator().manual_seed(0)
    blocks = torch.randperm(runner.num_blocks - 1, generator=g)[: -(-n // BLOCK)].add(1).tolist()
    times = {name: {"export": [], "total": []} for name in PATHS}
    for i in range(iters + 2):   # two warm-up samples per path, dropped
        order = list(PATHS) if i % 2 == 0 else list(PATHS)[::-1]
        for name in order:
            key = f"bench/{uuid.uuid4().hex[:8]}"
            t0 = time.perf_counter()
            handle = PATHS[name](runner, producer, key, blocks, n)
            t1 = time.perf_counter()
            payload = consumer.get(key, handle, timeout=30)
            t2 = time.perf_counter()
            assert payload["kv"].shape[2] == n and payload["num_tokens"] == n
            del payload
            consumer.delete(key)
            if i >= 2:
                times[name]["export"].append(t1 - t0)
                times[name]["total"].append(t2 - t0)
    return {"tokens": n, **{name: {part: (min(v) * 1e3, statistics.median(v) * 1e3) for part, v in t.items()}
                            for name, t in times.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-mib", type=float, nargs="+", default=[1, 8, 32])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--backends", nargs="+", default=["shared_memory", "mooncake_transfer_engine"])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="omnirelay-kvexport-")
    shm_dir = tempfile.mkdtemp(prefix="omnirelay-kvexport-", dir="/dev/shm")
    try:
        from omnirelay.deploy.builders.llm import build_tiny_llm
        model = LlamaModel(str(build_tiny_llm(os.path.join(work, "tiny-llm"), seed=0)))
        # A pool twice the longest sequence, so its blocks can be scattered.
        runner = local_runner(model, block_size=BLOCK, budget_bytes=int(2 * max(args.kv_mib) * (1 << 20)) + (4 << 20))
        for pool in (*runner.cache.keys, *runner.cache.values):
            pool.copy_(torch.randn(pool.shape))
        print("| backend | KV MiB | tokens | export ms copy / in place (best; median) | "
              "export + get ms copy / in place (best; median) |")
        print("|---|---:|---:|---|---|")
        for backend in args.backends:
            options = ({"shm_dir": shm_dir} if backend == "shared_memory" else
                       {"directory": os.path.join(shm_dir, "te"), "pool_mb": 4 * max(args.kv_mib) + 16}
                       if backend == "mooncake_transfer_engine" else {})
            try:
                producer = create_connector(backend, options)
            except ImportError as exc:
                print(f"{backend}: skipped ({exc})", file=sys.stderr)
                continue
            consumer = create_connector(backend, options)
            try:
                for mib in args.kv_mib:
                    r = measure(producer, consumer, runner, mib, args.iters)
                    cells = [" / ".join(f"{r[p][part][0]:.2f}" for p in PATHS) + "; "
                             + " / ".join(f"{r[p][part][1]:.2f}" for p in PATHS) for part in ("export", "total")]
                    print(f"| {backend} | {mib:g} | {r['tokens']} | {cells[0]} | {cells[1]} |", flush=True)
            finally:
                consumer.close()
                producer.close()
        print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
