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
  ``get_into`` between warm registered buffers, then ``remove``). Like the connectors, the raw
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

The script starts its own ``redis-server`` and ``mooncake_master`` on free ports of 127.0.0.1 and
stops them by PID; backends whose library or server is missing are reported as skipped. The
producer and consumer are child processes driven over pipes with JSON lines (no pickle).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

MIB = 1 << 20
BASELINE_PACKAGE = "omnirelay_bench_baseline"


# ------------------------------------------------------------------------------ child side


def _child(role: str, kind: str, options: dict) -> int:
    import torch
    torch.set_num_threads(1)
    out = sys.stdout

    def say(obj) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    state: dict = {}
    if kind == "tcp":
        if role == "consumer":
            server = socket.socket()
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            say({"ready": server.getsockname()[1]})
            state["sock"], _ = server.accept()
            server.close()
        else:
            say({"ready": 0})
    elif kind == "raw_redis":
        import redis
        state["r"] = redis.Redis.from_url(options["url"])
        say({"ready": 0})
    elif kind == "raw_te":
        from mooncake.engine import TransferEngine
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        state["engine"], state["peer"] = engine, f"127.0.0.1:{engine.get_rpc_port()}"
        say({"ready": 0})
    elif kind == "raw_store":
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        store = MooncakeDistributedStore()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", options["segment_mb"] << 20, 16 << 20, "tcp", "",
                           options["master"]) == 0
        config = ReplicateConfig()
        config.preferred_segment = store.get_hostname()
        state["store"], state["config"] = store, config
        say({"ready": 0})
    elif kind == "raw_shm":
        import mmap
        state["maps"] = {}   # size → (path, mapping), one warm segment per size, mapped once
        say({"ready": 0})
    elif kind.startswith("baseline:"):   # the connector as it was at --baseline REV
        import importlib
        from omnirelay.connectors import registry
        sys.path.insert(0, os.environ["OMNIRELAY_BENCH_BASELINE"])
        module_name, class_name = registry._BACKENDS[kind.split(":", 1)[1]].split(":")
        module = importlib.import_module(module_name.replace("omnirelay.connectors.", f"{BASELINE_PACKAGE}."))
        state["conn"] = getattr(module, class_name)(options)
        say({"ready": 0})
    else:
        from omnirelay.connectors import create_connector
        state["conn"] = create_connector(kind, options)
        say({"ready": 0})

    buffers: dict[int, object] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        size = cmd.get("size", 0)
        if op == "connect":
            state["sock"] = socket.create_connection(("127.0.0.1", cmd["port"]))
            say({})
            continue
        if size not in buffers:   # warm source / destination buffers, allocated once
            t = torch.ones(size, dtype=torch.uint8)
            t.add_(0)
            buffers[size] = t
            if "engine" in state:
                assert state["engine"].register_memory(t.data_ptr(), size) == 0
            if "store" in state:
                assert state["store"].register_buffer(t.data_ptr(), size) == 0
        data = buffers[size]
        if kind == "tcp":
            sock = state["sock"]
            if op == "send":
                t0 = time.perf_counter()
                sock.sendall(memoryview(data.numpy()))
                say({"t0": t0})
            else:
                view, got = memoryview(data.numpy()), 0
                while got < size:
                    got += sock.recv_into(view[got:], size - got)
                say({"t1": time.perf_counter()})
        elif kind == "raw_redis":
            r = state["r"]
            if op == "put":
                value = state.setdefault(("bytes", size), bytes(data.numpy()))
                t0 = time.perf_counter()
                r.set(cmd["key"], value)
                say({"dt": time.perf_counter() - t0, "handle": None})
            else:
                t0 = time.perf_counter()
                value = r.get(cmd["key"])
                dt = time.perf_counter() - t0
                assert value is not None and len(value) == size
                del value
                r.delete(cmd["key"])
                say({"dt": dt})
        elif kind == "raw_shm":   # no protocol: one copy into a mapped segment, one view of it
            path = os.path.join(options["shm_dir"], f"raw-{size}")
            if size not in state["maps"]:
                fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
                os.ftruncate(fd, size)
                state["maps"][size] = mmap.mmap(fd, size)
                os.close(fd)
            mapping = state["maps"][size]
            if op == "put":
                t0 = time.perf_counter()
                memoryview(mapping)[:] = memoryview(data.numpy())
                say({"dt": time.perf_counter() - t0, "handle": None})
            else:
                t0 = time.perf_counter()
                view = torch.frombuffer(mapping, dtype=torch.uint8, count=size)
                dt = time.perf_counter() - t0
                del view
                say({"dt": dt})
        elif kind == "raw_te":   # the data sits in the producer's registered buffer; the consumer reads it
            if op == "put":
                say({"dt": 0.0, "handle": {"peer": state["peer"], "addr": data.data_ptr()}})
            else:
                t0 = time.perf_counter()
                rc = state["engine"].transfer_sync_read(cmd["handle"]["peer"], data.data_ptr(), cmd["handle"]["addr"],
                                                        size)
                dt = time.perf_counter() - t0
                assert rc == 0
                say({"dt": dt})
        elif kind == "raw_store":
            store = state["store"]
            if op == "put":
                t0 = time.perf_counter()
                rc = store.upsert_from(cmd["key"], data.data_ptr(), size, state["config"])
                say({"dt": time.perf_counter() - t0, "handle": None})
                assert rc == 0
            else:
                t0 = time.perf_counter()
                got = store.get_into(cmd["key"], data.data_ptr(), size)
                dt = time.perf_counter() - t0
                assert got == size
                store.remove(cmd["key"], True)
                say({"dt": dt})
        else:
            conn = state["conn"]
            if op == "put" and cmd.get("in_place"):
                # The producer builds its tensor in connector memory: reserve and publish are
                # timed; its own write of the bytes (which produces them) is not.
                t0 = time.perf_counter()
                reservation = conn.reserve({"t": ((size,), torch.uint8)})
                dt = time.perf_counter() - t0
                reservation.tensors["t"].copy_(data)
                t0 = time.perf_counter()
                handle = conn.put_reserved(cmd["key"], reservation)
                say({"dt": dt + time.perf_counter() - t0, "handle": handle})
            elif op == "put":
                t0 = time.perf_counter()
                handle = conn.put(cmd["key"], {"t": data})
                say({"dt": time.perf_counter() - t0, "handle": handle})
            else:
                t0 = time.perf_counter()
                payload = conn.get(cmd["key"], cmd["handle"], timeout=60)
                if cmd.get("touch"):
                    payload["t"].view(torch.int64).sum()   # read every byte
                dt = time.perf_counter() - t0
                assert payload["t"].numel() == size
                del payload
                conn.delete(cmd["key"])
                say({"dt": dt})
    if "conn" in state:
        state["conn"].close()
    if "store" in state:
        state["store"].close()
    return 0


# ----------------------------------------------------------------------------- parent side


class Child:
    def __init__(self, role: str, kind: str, options: dict, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", role, kind, json.dumps(options)],
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


# --------------------------------------------------------------------------------- servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"server on port {port} did not start")


def start_redis(workdir: str) -> tuple[subprocess.Popen, str] | None:
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir, "--loglevel", "warning"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    _wait_port(port, proc)
    return proc, f"redis://127.0.0.1:{port}/0"


def start_mooncake_master() -> tuple[subprocess.Popen, str] | None:
    binary = shutil.which("mooncake_master", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                                 os.environ.get("PATH", "")]))
    if binary is None:
        return None
    port = _free_port()
    proc = subprocess.Popen([binary, f"--rpc_port={port}", "--rpc_address=127.0.0.1", f"--metrics_port={_free_port()}",
                             "--metrics_host=127.0.0.1", "--rpc_thread_num=2", "--enable_metric_reporting=false"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "GLOG_minloglevel": "2"})
    _wait_port(port, proc)
    return proc, f"127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------- report


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Linux {platform.release()}, "
            f"Python {platform.python_version()}")


def _rounds(result) -> list[float]:
    return result["rounds"] if isinstance(result, dict) else result


def aggregate(per_round: list[dict]) -> dict:
    """One row's results over the rounds: medians, and the per-round best GB/s under "rounds"."""
    if not isinstance(per_round[0], dict):   # a reference copy: per-round GB/s
        return {"gbps": statistics.median(per_round), "rounds": per_round}
    out = {k: statistics.median(r[k] for r in per_round) for k in ("gbps", "median_gbps", "put_ms", "get_ms")}
    out["rounds"] = [r["gbps"] for r in per_round]
    return out


def render(results: dict, sizes: list[int], command: str, refs: dict) -> str:
    def cell(name, size):
        r = results.get(name, {}).get(size)
        if r is None:
            return "skipped"
        return f"{r['gbps']:.2f}"

    lines = [f"Command: `{command}`", "", f"Machine: {machine()}.", "",
             ("put+get GB/s between two processes (best of the iterations, median over the rounds; in "
              "parentheses the share of the reference transport, median of the per-round ratios — for shared "
              "memory: of memcpy / of the cold-cache memcpy):"), "",
             "| | " + " | ".join(f"{s // MIB} MiB" for s in sizes) + " | reference |",
             "|---|" + "---|" * len(sizes) + "---|"]
    for name in ("memcpy", "memcpy, cold cache", "raw shared memory", "raw TCP", "raw Redis SET/GET",
                 "raw Mooncake TE", "raw Mooncake store"):
        lines.append(f"| {name} | " + " | ".join(cell(name, s) for s in sizes) + " | |")
    for name, ref_names in refs.items():
        cells = []
        for s in sizes:
            r = results.get(name, {}).get(s)
            if r is None:
                cells.append(results.get(name, {}).get("skipped", "skipped"))
                continue
            shares = []
            for ref in ref_names:
                base = results.get(ref, {}).get(s)
                if base is None:
                    continue
                ratios = [mine / theirs for mine, theirs in zip(r["rounds"], _rounds(base)) if theirs]
                if ratios:
                    shares.append(f"{100 * statistics.median(ratios):.0f} %")
            cells.append(f"{r['gbps']:.2f}" + (f" ({' / '.join(shares)})" if shares else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {' / '.join(ref_names)} |")
    lines += ["", ("The best iteration's put / get in ms, and the median iteration's put+get GB/s (each the "
                   "median over the rounds):"), "",
              "| | " + " | ".join(f"{s // MIB} MiB" for s in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for name in ["raw shared memory", "raw Redis SET/GET", "raw Mooncake TE", "raw Mooncake store", *refs]:
        row = []
        for s in sizes:
            r = results.get(name, {}).get(s)
            row.append(f"{r['put_ms']:.2f} / {r['get_ms']:.2f}; median {r['median_gbps']:.2f} GB/s"
                       if isinstance(r, dict) else "–")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- benchmarks/connectors.py: begin -->\n", "<!-- benchmarks/connectors.py: end -->\n"


def update_section(path: Path, body: str) -> None:
    """Put ``body`` between the generated-results markers of the ``## Connectors`` section (creating
    the file, the section or the markers if missing); prose around the markers and every other
    section stay as they are."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = BEGIN + body + END
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        lines = text.splitlines(keepends=True)
        start = next((i for i, line in enumerate(lines) if line.strip() == "## Connectors"), None)
        if start is None:
            text = text.rstrip("\n") + "\n\n## Connectors\n\n" + block
        else:
            end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
            lines[end:end] = ["\n" if lines[end - 1].strip() else "", block, "\n" if end < len(lines) else ""]
            text = "".join(lines)
    path.write_text(text)


def extract_baseline(rev: str, into: str) -> str:
    """Write the ``connectors`` package as of git revision ``rev`` under ``into`` (as package
    :data:`BASELINE_PACKAGE`); returns the short revision. Its modules import each other
    relatively, so they load side by side with the current ones."""
    root = Path(__file__).resolve().parent.parent
    git = ["git", "-C", str(root)]
    short = subprocess.run([*git, "rev-parse", "--short", rev], check=True, capture_output=True, text=True).stdout.strip()
    names = subprocess.run([*git, "ls-tree", "--name-only", rev, "connectors/"], check=True, capture_output=True,
                           text=True).stdout.split()
    package = Path(into) / BASELINE_PACKAGE
    package.mkdir()
    for name in names:
        if name.endswith(".py"):
            source = subprocess.run([*git, "show", f"{rev}:{name}"], check=True, capture_output=True).stdout
            (package / Path(name).name).write_bytes(source)
    return short


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return _child(argv[1], argv[2], json.loads(argv[3]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="repeat everything, interleaved; report medians")
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also measure shared_memory and mooncake_transfer_engine as of this git revision")
    parser.add_argument("--backends", nargs="+", default=["shared_memory", "redis", "mooncake_transfer_engine",
                                                          "mooncake_store"])
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
        if args.baseline:
            rev = extract_baseline(args.baseline, workdir)
            os.environ["OMNIRELAY_BENCH_BASELINE"] = workdir   # inherited by the child processes
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
