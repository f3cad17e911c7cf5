"""Serving A/B: two omnirelay trees (two checkouts, each with its own venv) under the same load,
in alternating rounds, to tell whether a change moved serving throughput or latency.

Made for refactors that should not change speed (issue #18: the worker package moves). Each tree
serves its own model directory (built by its own ``omni-make-model``; compare the bytes first) with
``python -m omnirelay.deploy.serve MODEL`` at defaults; one client, ``omni-bench``, loads both, so
the client is held constant.

A round, for each tree in turn (the order alternates: A B, B A, A B, ...): start that tree's server
on its own loopback port, wait until ``/v1/models`` lists the served name, one unmeasured warm-up
pass (``--warmup-prompts``, its own seed), the measured pass (seed = round number: both trees get
the same prompts in a round, no round reuses another's), stop the server's process group. Only one
server is up at a time, so the idle one's heartbeats do not land in the other's numbers; every
measured server starts cold, so start-up luck is part of each side alike. After each stop the
script checks that no process of that group is left and no ``/dev/shm`` entry named after one of
its PIDs (``omnirelay-PID-...``) remains.

Prints every pass and the medians (output tok/s, TTFT p50, TPOT p50, E2E p50, and the server
process group's CPU per output token, per process too, from ``/proc``) with the ratio B/A,
and writes it all as JSON with ``--json``.

Usage::

    python benchmarks/serve_ab.py --a before=/tmp/x/.venv/bin/python=/tmp/m/tiny-x \\
        --b after=/tmp/y/.venv/bin/python=/tmp/m/tiny-y --client /tmp/y/.venv/bin/omni-bench \\
        --rounds 4 --work-dir /tmp/ab --json /tmp/ab/ab.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

from servers import HttpServer   # benchmarks/servers.py, beside this script

CLIENT_FIGURES = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "median_e2el_ms", "p99_ttft_ms")
FIGURES = (*CLIENT_FIGURES, "server_cpu_ms_per_token")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S', time.gmtime())}Z] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Tree:
    name: str
    python: str
    model: str
    port: int

    @classmethod
    def parse(cls, spec: str, port: int) -> "Tree":
        name, python, model = spec.split("=", 2)
        return cls(name, python, model, port)


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def group_pids(pgid: int) -> set[int]:
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    pids.add(int(entry))
            except ProcessLookupError:
                pass
    return pids


def process_name(pid: int) -> str:
    """gateway / broker / the worker's role / serve (the launcher), from the command line."""
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        argv = handle.read().decode(errors="replace").split("\0")
    if "--role" in argv:
        return argv[argv.index("--role") + 1]
    for name in ("gateway", "broker"):
        if any(f"omnirelay.{name}." in arg for arg in argv):
            return name
    return "serve"


def cpu_seconds(pgid: int) -> dict[str, float]:
    """User + system CPU of each live process of the group, summed per process name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in group_pids(pgid):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            name = process_name(pid)
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick   # utime, stime
    return out


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class Server(HttpServer):
    """One tree's omni-serve, in its own process group; stopped by that group's id."""

    def __init__(self, tree: Tree, served: str, log_path: pathlib.Path):
        self.tree = tree
        # cwd=/ so neither interpreter can pick up a tree from the current directory.
        super().__init__(tree.name, [tree.python, "-m", "omnirelay.deploy.serve", tree.model, "--host", "127.0.0.1",
                                     "--port", str(tree.port), "--served-model-name", served],
                         tree.port, served, log_path, cwd="/")

    def stop(self) -> set[int]:
        """Stops the group; returns the PIDs it had (their shared-memory names start omnirelay-PID-)."""
        pgid = self.proc.pid
        pids = group_pids(pgid)
        if self.proc.poll() is None:
            os.killpg(pgid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                log(f"{self.tree.name}: SIGKILL after 60 s")
                os.killpg(pgid, signal.SIGKILL)
                self.proc.wait(10)
        deadline = time.monotonic() + 30
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if group_alive(pgid):
            log(f"{self.tree.name}: processes left in group {pgid}; SIGKILL")
            os.killpg(pgid, signal.SIGKILL)
        self._log.close()
        return pids


def bench(client: str, server: Server, tokenizer: str, args, seed: int, prompts: int, result: pathlib.Path) -> dict:
    cmd = [client, "--base-url", server.url, "--model", server.served, "--tokenizer", tokenizer,
           "--dataset-name", "random", "--random-input-len", str(args.input_len), "--output-len",
           str(args.output_len), "--num-prompts", str(prompts), "--max-concurrency", str(args.concurrency),
           "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--no-progress", "--result-file", str(result)]
    with open(result.with_suffix(".log"), "w") as out:
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT, timeout=args.pass_timeout, cwd="/")
    raw = json.loads(result.read_text())
    return {"cmd": cmd, "completed": raw["completed"], "output_tokens": raw["total_output_tokens"],
            **{k: raw[k] for k in CLIENT_FIGURES}}


def one_pass(tree: Tree, round_no: int, args, work: pathlib.Path) -> dict:
    shm_before = shm_entries()
    load_start = os.getloadavg()[0]
    server = Server(tree, args.served_name, work / f"{tree.name}-{round_no}.serve.log")
    try:
        ready_s = server.wait_ready(args.ready_timeout)
        bench(args.client, server, args.tokenizer or tree.model, args, 1000 + round_no, args.warmup_prompts,
              work / f"{tree.name}-{round_no}-warmup.json")
        # CPU the server spends per output token: on a host shared with other work it moves far less
        # than wall-clock throughput does, so it shows a code-path cost the wall clock would hide.
        cpu_before = cpu_seconds(server.proc.pid)
        res = bench(args.client, server, args.tokenizer or tree.model, args, round_no, args.num_prompts,
                    work / f"{tree.name}-{round_no}.json")
        cpu_after = cpu_seconds(server.proc.pid)
    finally:
        pids = server.stop()
    # Other work on the host makes its own /dev/shm entries; ours are named after our PIDs.
    leaked = sorted(name for name in shm_entries() - shm_before
                    if any(name.startswith(f"omnirelay-{pid}-") for pid in pids))
    if leaked:
        log(f"{tree.name}: /dev/shm entries of the server left after stop: {leaked}")
    cpu = {name: cpu_after[name] - cpu_before.get(name, 0.0) for name in cpu_after}
    res["server_cpu_ms_per_token"] = 1000 * sum(cpu.values()) / res["output_tokens"]
    res["cpu_ms_per_token_by_process"] = {name: 1000 * v / res["output_tokens"] for name, v in cpu.items()}
    return {"tree": tree.name, "round": round_no, "ready_s": ready_s, "load_1m_start": load_start,
            "load_1m_end": os.getloadavg()[0], "shm_left": leaked, "server_cmd": server.cmd, **res}


def medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in FIGURES}


# Two-sided 95 % Student t quantiles by degrees of freedom (rounds - 1); 1.96 past the table.
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
       15: 2.13, 20: 2.09, 30: 2.04}


def paired_ratios(results: dict) -> dict[str, tuple[float, float, float]]:
    """Per figure: the geometric mean of each round's B/A ratio and its 95 % interval (t on the
    log ratios). Pairing by round cancels the host's drift between rounds: both passes of a round
    ran back to back."""
    a, b = results["a"], results["b"]
    by_round: dict[int, dict[str, dict]] = {}
    for r in results["runs"]:
        by_round.setdefault(r["round"], {})[r["tree"]] = r
    pairs = [(p[a], p[b]) for p in by_round.values() if a in p and b in p]
    out = {}
    for k in FIGURES:
        logs = [math.log(y[k] / x[k]) for x, y in pairs if x[k] > 0 and y[k] > 0]
        if len(logs) < 2:
            continue
        mean = statistics.mean(logs)
        df = len(logs) - 1
        t = T95[max(d for d in T95 if d <= df)] if df <= 30 else 1.96
        half = t * statistics.stdev(logs) / math.sqrt(len(logs))
        out[k] = (math.exp(mean), math.exp(mean - half), math.exp(mean + half))
    return out


def markdown(results: dict) -> str:
    a, b = results["a"], results["b"]
    lines = ["| round | order | tree | out tok/s | TTFT p50 ms | TPOT p50 ms | E2E p50 ms | TTFT p99 ms | "
             "server CPU ms/token | load 1m |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        lines.append(f"| {r['round']} | {r['order']} | {r['tree']} | {r['output_throughput']:.0f} | "
                     f"{r['median_ttft_ms']:.1f} | {r['median_tpot_ms']:.2f} | {r['median_e2el_ms']:.0f} | "
                     f"{r['p99_ttft_ms']:.0f} | {r['server_cpu_ms_per_token']:.3f} | {r['load_1m_start']:.2f} |")
    ma, mb = results["median"][a], results["median"][b]
    paired = paired_ratios(results)
    lines += ["", f"| median | {a} | {b} | {b}/{a} | paired {b}/{a} [95 %] |", "|---|---|---|---|---|"]
    for k in FIGURES:
        ratio = f"{paired[k][0]:.3f} [{paired[k][1]:.2f}, {paired[k][2]:.2f}]" if k in paired else ""
        lines.append(f"| {k} | {ma[k]:.2f} | {mb[k]:.2f} | {mb[k] / ma[k]:.3f} | {ratio} |")
    lines += ["", f"| CPU ms/token by process (median) | {a} | {b} |", "|---|---|---|"]
    names = sorted({n for r in results["runs"] for n in r.get("cpu_ms_per_token_by_process", {})})
    for name in names:
        cells = [statistics.median(r["cpu_ms_per_token_by_process"].get(name, 0.0) for r in results["runs"]
                                   if r["tree"] == tree) for tree in (a, b)]
        lines.append(f"| {name} | {cells[0]:.3f} | {cells[1]:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", help="NAME=PYTHON=MODEL_DIR of the reference tree")
    ap.add_argument("--b", help="NAME=PYTHON=MODEL_DIR of the tree under test")
    ap.add_argument("--a-port", type=int, default=8031)
    ap.add_argument("--b-port", type=int, default=8041)
    ap.add_argument("--client", help="the omni-bench executable used for both")
    ap.add_argument("--tokenizer", help="model directory that sizes the prompts (default: each tree's model)")
    ap.add_argument("--served-name", default="tiny")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--warmup-prompts", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--pass-timeout", type=float, default=600)
    ap.add_argument("--work-dir", type=pathlib.Path)
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--report", type=pathlib.Path, help="print the tables of an earlier --json file; run nothing")
    args = ap.parse_args(argv)
    if args.report:
        print(markdown(json.loads(args.report.read_text())))
        return 0
    missing = [f"--{name.replace('_', '-')}" for name in ("a", "b", "client", "work_dir") if not getattr(args, name)]
    if missing:
        ap.error(f"to run passes, give {', '.join(missing)}")
    trees = [Tree.parse(args.a, args.a_port), Tree.parse(args.b, args.b_port)]
    args.work_dir.mkdir(parents=True, exist_ok=True)

    results: dict = {"a": trees[0].name, "b": trees[1].name, "cores": os.cpu_count(),
                     "load_avg_start": os.getloadavg(), "start_utc": time.strftime("%H:%M:%S", time.gmtime()),
                     "runs": []}
    for round_no in range(args.rounds):
        order = trees if round_no % 2 == 0 else trees[::-1]
        for position, tree in enumerate(order):
            res = one_pass(tree, round_no, args, args.work_dir)
            res["order"] = position + 1
            results["runs"].append(res)
            log(f"round {round_no} #{position + 1} {tree.name}: {res['output_throughput']:.0f} tok/s, "
                f"TTFT p50 {res['median_ttft_ms']:.1f} ms, TPOT p50 {res['median_tpot_ms']:.2f} ms, "
                f"{res['completed']}/{args.num_prompts} done, ready after {res['ready_s']:.0f} s, "
                f"load {res['load_1m_start']:.2f}")
            if args.json:   # after every pass, so an interrupted run keeps what it measured
                args.json.write_text(json.dumps(results, indent=1))
    results["load_avg_end"] = os.getloadavg()
    results["end_utc"] = time.strftime("%H:%M:%S", time.gmtime())
    results["median"] = {t.name: medians([r for r in results["runs"] if r["tree"] == t.name]) for t in trees}
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
