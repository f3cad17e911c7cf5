"""LoRA serving cost (issue #29): output tok/s and TTFT with the base alone and with 1, 4 and 8
adapters mixed in one load, through omni-serve.

Two servers of the same base, started in turn by this script (only one is up at a time, in its own
process group, stopped by that group's id):

* ``plain``: ``omni-serve BASE`` without LoRA, serving the base-only load;
* ``lora``: ``omni-serve BASE --enable-lora --lora-modules a0=… … --max-loras M``, serving the
  base-only load again (what LoRA costs traffic that uses none) and then, for each adapter count
  k, a load whose requests name the adapters a0 … a(k-1) in turn (a seeded shuffle of the same
  prompts), as vLLM's bench client does with ``--lora-modules``.

Every load is the same random-token prompts (``--input-len``, ``--output-len``, ``ignore_eos``)
sent by omnirelay's bench client (``omnirelay.bench``: streamed completions, TTFT at the first
token) with ``--max-concurrency`` in flight, after ``--num-warmups`` unmeasured requests. With
``--rounds`` > 1 the servers alternate (plain, lora; lora, plain; …) and the table shows medians.
The adapters are random-weight ones written by ``omni-make-model tiny-lora`` for the base (rank
``--rank``, all seven projections), unless ``--lora-modules`` names existing ones.

Usage (the default base is a tiny one built into the work directory; for a real measurement give a
real base and a GPU)::

    python benchmarks/lora_serving.py --work-dir /tmp/lora-bench --model /models/Qwen2.5-0.5B-Instruct \\
        --adapters 1,4,8 --max-loras 8 --num-prompts 256 --max-concurrency 32 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import statistics
import subprocess
import sys
import time

from omnirelay.bench import metrics
from omnirelay.bench.client import Target, send_request
from omnirelay.bench.datasets import Tokenizer, random_prompts
from omnirelay.bench.runner import new_session
from servers import HttpServer, free_port   # benchmarks/servers.py, beside this script

FIGURES = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S', time.gmtime())}Z] {msg}", file=sys.stderr, flush=True)


async def load(url: str, models: list[str], prompts, args, seed: int) -> dict:
    """Warm-up, then every prompt once with request i naming ``models[order[i] % len]``; one summary."""
    targets = [Target(url=url + "/v1/completions", model=m, endpoint_type="completions", ignore_eos=True)
               for m in models]
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    slots = asyncio.Semaphore(args.max_concurrency)
    async with new_session(args.timeout) as session:
        async def one(i: int, prompt):
            async with slots:
                return await send_request(session, targets[order[i] % len(targets)], prompt)

        warm = await asyncio.gather(*(one(i, prompts[i % len(prompts)]) for i in range(args.num_warmups)))
        if warm and not any(r.success for r in warm):
            raise RuntimeError(f"every warm-up request failed: {warm[0].error}")
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        summary = metrics.summarize(list(results), time.perf_counter() - start)
    return {k: summary[k] for k in (*FIGURES, "completed", "failed", "total_output_tokens", "errors")}


def adapters(args, work: pathlib.Path, count: int) -> dict[str, str]:
    """``count`` adapters: ``--lora-modules`` ones first, then random ones built for the base."""
    given = dict(m.split("=", 1) for m in args.lora_modules or [])
    out = dict(list(given.items())[:count])
    if len(out) < count:
        from omnirelay.deploy.builders.lora import build_tiny_lora
        for i in range(len(out), count):
            out[f"a{i}"] = str(build_tiny_lora(args.model, work / "adapters" / f"a{i}", rank=args.rank, seed=i + 1))
    return out


def run(args) -> dict:
    work = pathlib.Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from omnirelay.deploy.builders.llm import build_tiny_llm
        args.model = str(work / "tiny-llm")
        if not (work / "tiny-llm" / "config.json").is_file():
            build_tiny_llm(args.model, seed=0)
    counts = sorted(set(args.adapters))
    modules = adapters(args, work, max(counts))
    names = list(modules)
    prompts = random_prompts(args.num_prompts, args.input_len, args.output_len, Tokenizer.from_dir(args.model),
                             seed=args.seed)
    served = "base"
    base_args = [args.model, "--served-model-name", served, *args.serve_arg]
    lora_args = [*base_args, "--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank",
                 str(args.max_lora_rank or args.rank), *(a for n, p in modules.items() for a in ("--lora-modules", f"{n}={p}"))]
    loads = {"plain": [("base only", [served])],
             "lora": [("base only (LoRA on)", [served]), *((f"{k} adapter{'s' * (k > 1)}", names[:k]) for k in counts)]}
    results: dict[str, list[dict]] = {}
    for round_no in range(args.rounds):
        for kind in (("plain", "lora") if round_no % 2 == 0 else ("lora", "plain")):
            log(f"round {round_no + 1}: starting the {kind} server")
            port = free_port()
            server = HttpServer(kind, [sys.executable, "-m", "omnirelay.deploy.serve",
                                       *(base_args if kind == "plain" else lora_args), "--host", "127.0.0.1",
                                       "--port", str(port), "--log-level", "WARNING"],
                                port, served, work / f"serve-{kind}-{round_no}.log")
            try:
                server.wait_ready(args.start_timeout)
                for label, models in loads[kind]:
                    figures = asyncio.run(load(server.url, models, prompts, args, seed=args.seed + round_no))
                    log(f"  {label}: {figures['output_throughput']:.1f} tok/s, TTFT p50 "
                        f"{figures['median_ttft_ms']:.1f} ms, {figures['failed']} failed")
                    results.setdefault(label, []).append(figures)
            finally:
                server.stop()
    return {"model": args.model, "adapters": modules, "num_prompts": args.num_prompts, "input_len": args.input_len,
            "output_len": args.output_len, "max_concurrency": args.max_concurrency, "max_loras": args.max_loras,
            "rounds": results}


def table(report: dict) -> str:
    lines = ["| load | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | failed |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, runs in report["rounds"].items():
        med = {f: statistics.median(r[f] for r in runs if r[f] is not None) if any(r[f] is not None for r in runs)
               else float("nan") for f in FIGURES}
        lines.append(f"| {label} | {med['output_throughput']:.1f} | {med['median_ttft_ms']:.1f} | "
                     f"{med['p99_ttft_ms']:.1f} | {med['median_tpot_ms']:.2f} | {sum(r['failed'] for r in runs)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", required=True, help="adapters, the tiny base (default) and server logs go here")
    ap.add_argument("--model", help="base model directory (default: a tiny-llm built into --work-dir)")
    ap.add_argument("--adapters", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 4, 8],
                    help="adapter counts to mix, comma-separated (default 1,4,8)")
    ap.add_argument("--lora-modules", action="append", metavar="NAME=PATH", help="existing adapters to use first")
    ap.add_argument("--rank", type=int, default=8, help="rank of the built adapters")
    ap.add_argument("--max-loras", type=int, default=8, help="the lora server's --max-loras")
    ap.add_argument("--max-lora-rank", type=int, default=0,
                    help="the lora server's --max-lora-rank (default --rank; the slots are this wide)")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--num-warmups", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a server to become ready")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more omni-serve argument, both servers (repeatable; --serve-arg=--dtype --serve-arg=bfloat16)")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    if not args.adapters or min(args.adapters) < 1 or args.rounds < 1 or args.max_concurrency < 1:
        ap.error("--adapters counts, --rounds and --max-concurrency must be >= 1")
    report = run(args)
    print(table(report))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
