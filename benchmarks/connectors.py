"""Connector throughput: put + get between two processes, per backend, beside its raw transport.

    python benchmarks/connectors.py [--sizes-mib 1 16 64] [--iters 10] [--rounds 1] [--baseline REV]
                                    [--update BENCHMARKS.md]

For every size, one payload ``{"t": uint8 tensor of N bytes}`` goes from a producer process to a
consumer process, repeatedly:

* ``put+get GB/s`` = N / the fastest (put time + get time) over the iterations; the machine is
  shared, so the minimum is the stable estimate of what the code can do, and it is taken the same
  way for every row, references included. ``put`` returns when the payload is readable; ``get``
  returns tensors ready to use (received into local memory for the network backends; zero-copy
  views for shared memory, whose pages are mapped lazily — the row "shared_memory, consumer reads
  every byte" adds a full read of the payload to ``get``). The consumer deletes each key after the
  get, as the decode worker does; that is not timed.
* References, same sizes: ``memcpy`` (one copy between two warm buffers in one process; best of
  50, measured before and after the backends); ``memcpy, cold cache`` (the same after writing a
  256 MiB scratch buffer: in the two-process rows the payload was not just touched by the same
  core, so at 1 and 16 MiB, which fit the L3 cache, plain ``memcpy`` is the optimistic bound and
  the cold copy the realistic one); ``raw shared memory`` (the floor of any shared-memory
  hand-off between two processes: the producer copies into a segment both keep mapped, the
  consumer makes one tensor view of it — no lookup, lease, header or publication, so not a usable
  protocol: a reader could see the next write); ``raw TCP`` (one ``sendall`` over loopback into a warm
  ``recv_into`` buffer, timed from the first byte sent to the last byte received); ``raw Redis``
  (redis-py with hiredis: ``SET`` of the bytes, ``GET``, ``DEL``); ``raw Mooncake TE`` (one
  ``transfer_sync_read`` of N bytes between two warm registered buffers: the transport the
  ``mooncake_transfer_engine`` connector rides on); ``raw Mooncake store`` (``upsert_from``, then
  ``get_into`` between warm registered buffers, then ``remove``); ``raw Yuanrong KV`` (the datasystem's
  ``KVClient``: ``set`` of the bytes, ``get`` into a new ``bytes``, ``delete``). Like the connectors, the raw
  rows use a fresh key per iteration and run between two processes.
* Rows ``…, in place (reserve → put_reserved)``: the producer builds the payload in memory the
  connector lends (as the prefill gathers its KV), so ``put`` is ``reserve`` + ``put_reserved``
  and no copy; the producer's own write of the bytes is not timed (it replaces the write that
  produced the tensor, not an extra one).

``--rounds N`` repeats the whole measurement N times, interleaved (every row of a size, then the
next size, then the next round), and reports per row the median over the rounds of its best-of-
iterations GB/s, and per share the median over the rounds of that round's ratio: on a shared host
a ratio taken within one round is what stays comparable. ``--baseline REV`` adds rows for the
``shared_memory`` and ``mooncake_transfer_engine`` connectors as they were at git revision ``REV``
(their package is extracted from git into a temporary directory and imported from there), so a
change is measured against its predecessor side by side, in the same run.

The script starts its own ``redis-server``, ``mooncake_master`` and openYuanrong ``datasystem_worker``
(:mod:`omnirelay.deploy.yuanrong_worker`) on free ports of 127.0.0.1 and stops them by PID; backends whose library or server is missing are reported as skipped. The
producer and consumer are child processes driven over pipes with JSON lines (no pickle).

Its parts: ``connector_child.py`` (one side of a transfer, in its own process), ``connector_runs.py``
(the measurements), ``connector_report.py`` (the tables and their place in BENCHMARKS.md),
``connector_baseline.py`` (``--baseline REV``) and ``servers.py`` (Redis and the Mooncake master).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from connector_baseline import BASELINE_DIR_ENV, extract_baseline
from connector_report import aggregate, render, update_section
from connector_runs import MIB, measure_memcpy, measure_memcpy_cold, measure_pair, measure_tcp
from servers import start_mooncake_master, start_redis, stop


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="repeat everything, interleaved; report medians")
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also measure shared_memory and mooncake_transfer_engine as of this git revision")
    parser.add_argument("--backends", nargs="+", default=["shared_memory", "redis", "mooncake_transfer_engine",
                                                          "mooncake_store", "yuanrong"])
    parser.add_argument("--update", type=Path, default=None,
                        help="write the results into this file's Connectors section")
    args = parser.parse_args(argv)
    command = "python benchmarks/connectors.py " + " ".join(argv)
    sizes = [s * MIB for s in args.sizes_mib]
    per_round: dict = {}   # row → size → [result of each round]
    results: dict = {}
    workdir = tempfile.mkdtemp(prefix="omnirelay-bench-")
    shm_dir = f"/dev/shm/omnirelay-bench-{uuid.uuid4().hex[:8]}"
    os.mkdir(shm_dir)
    te_dir = f"/dev/shm/omnirelay-bench-te-{uuid.uuid4().hex[:8]}"
    servers = []
    datasystem = None
    try:
        redis_server = start_redis(workdir) if "redis" in args.backends else None
        master = None
        if {"mooncake_transfer_engine", "mooncake_store"} & set(args.backends):
            try:
                import mooncake.engine  # noqa: F401
                master = start_mooncake_master()
            except ImportError as exc:
                results["mooncake_transfer_engine"] = results["mooncake_store"] = {"skipped": f"skipped ({exc})"}
        servers = [s[0] for s in (redis_server, master) if s]
        pool_mb = 4 * max(args.sizes_mib) + 64
        if "yuanrong" in args.backends:
            from omnirelay.deploy.yuanrong_worker import LocalYuanrongWorker, YuanrongUnavailable
            try:
                datasystem = LocalYuanrongWorker(os.path.join(workdir, "yuanrong"), shared_memory_mb=2 * pool_mb)
                datasystem.start()
            except YuanrongUnavailable as exc:
                datasystem = None
                results["yuanrong"] = {"skipped": f"skipped ({exc})"}
        cold = ("memcpy", "memcpy, cold cache")
        configs = {   # row → (connector, options, extra measure_pair arguments, reference rows)
            "shared_memory": ("shared_memory", {"shm_dir": shm_dir}, {}, cold),
            "shared_memory, consumer reads every byte": ("shared_memory", {"shm_dir": shm_dir}, {"touch": True}, cold),
            "shared_memory, fresh segment per put (pool_mb: 0)": ("shared_memory", {"shm_dir": shm_dir, "pool_mb": 0},
                                                                  {}, cold),
        }
        configs["shared_memory, in place (reserve → put_reserved)"] = ("shared_memory", {"shm_dir": shm_dir},
                                                                       {"in_place": True}, cold)
        if redis_server:
            configs["redis"] = ("redis", {"url": redis_server[1], "pool_mb": pool_mb}, {}, ("raw Redis SET/GET",))
        if master:
            configs["mooncake_transfer_engine"] = ("mooncake_transfer_engine", {"directory": te_dir, "pool_mb": pool_mb},
                                                   {}, ("raw Mooncake TE",))
            configs["mooncake_transfer_engine, in place (reserve → put_reserved)"] = (
                "mooncake_transfer_engine", {"directory": te_dir, "pool_mb": pool_mb}, {"in_place": True},
                ("raw Mooncake TE",))
            configs["mooncake_store"] = ("mooncake_store", {"master": master[1], "pool_mb": pool_mb,
                                                            "segment_mb": pool_mb}, {}, ("raw Mooncake store",))
        if datasystem:
            # A 64 MiB payload takes longer than the connector's 2 s default under load: the benchmark
            # measures throughput, not outage detection.
            options = {"address": datasystem.address, "pool_mb": pool_mb, "request_timeout_s": 30}
            configs["yuanrong"] = ("yuanrong", options, {}, ("raw Yuanrong KV",))
            configs["yuanrong, in place (reserve → put_reserved)"] = ("yuanrong", options, {"in_place": True},
                                                                     ("raw Yuanrong KV",))
        if args.baseline:
            rev = extract_baseline(args.baseline, workdir)
            os.environ[BASELINE_DIR_ENV] = workdir   # inherited by the child processes
            for name in ("shared_memory", "shared_memory, consumer reads every byte", "mooncake_transfer_engine"):
                if name in configs:
                    kind, options, extra, refs = configs[name]
                    configs[f"{name} @ {rev}"] = (f"baseline:{kind}", options, extra, refs)
        for round_index in range(args.rounds):
            for size in sizes:
                iters = args.iters if size < 64 * MIB else max(5, args.iters // 2)
                print(f"-- round {round_index + 1}/{args.rounds}, {size // MIB} MiB", flush=True)
                row: dict = {"memcpy": measure_memcpy(size, 50), "memcpy, cold cache": measure_memcpy_cold(size, 20),
                             "raw TCP": measure_tcp(size, iters, args.warmup)}
                if "shared_memory" in args.backends:
                    row["raw shared memory"] = measure_pair("raw_shm", {"shm_dir": shm_dir}, size, iters, args.warmup)
                if redis_server:
                    row["raw Redis SET/GET"] = measure_pair("raw_redis", {"url": redis_server[1]}, size, iters,
                                                            args.warmup)
                if master:
                    row["raw Mooncake TE"] = measure_pair("raw_te", {}, size, iters, args.warmup)
                    row["raw Mooncake store"] = measure_pair("raw_store", {"master": master[1], "segment_mb": pool_mb},
                                                             size, iters, args.warmup)
                if datasystem:
                    row["raw Yuanrong KV"] = measure_pair("raw_yuanrong", {"address": datasystem.address}, size, iters,
                                                          args.warmup)
                for name, (kind, options, extra, _) in configs.items():
                    if kind.removeprefix("baseline:") not in args.backends:
                        continue
                    row[name] = measure_pair(kind, options, size, iters, args.warmup, **extra)
                    print(f"   {name}: {row[name]['gbps']:.2f} GB/s", flush=True)
                # The host is shared: measure the copy again after the backends and keep the faster run.
                row["memcpy"] = max(row["memcpy"], measure_memcpy(size, 50))
                for name, result in row.items():
                    per_round.setdefault(name, {}).setdefault(size, []).append(result)
    finally:
        for proc in servers:
            stop(proc)
        if datasystem is not None:
            datasystem.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(te_dir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    for name, by_size in per_round.items():
        for size, rounds in by_size.items():
            results.setdefault(name, {})[size] = aggregate(rounds)
    report = render(results, sizes, command, {name: config[3] for name, config in configs.items()})
    print(report)
    if args.update:
        update_section(args.update, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
