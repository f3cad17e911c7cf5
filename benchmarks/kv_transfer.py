"""Prefill → decode time to the first decode token, whole-KV vs layer-by-layer export, side by side.

    python benchmarks/kv_transfer.py [--model DIR] [--prompt-lens 1024 2000] [--repeats 5]
                                     [--backends shared_memory redis] [--max-batched-tokens 4096]
                                     [--device cpu|cuda] [--dtype float32|bfloat16]

What one sample measures (both engines in this process, the connector between them as between two
workers; the broker hop, the same for both modes, is left out): ``t0`` the prompt is added to the
prefill engine → prefill steps until its result (the first token; the KV handed off: whole after
the forward, or layer by layer during it) → the decode engine takes the task, imports the KV into
its pool and runs its first step → ``t1`` the first decode token. TTFT at decode = ``t1 - t0``;
``prefill`` is the prefill part (forward + export), ``decode`` the rest (import + first step), and
``tail`` = prefill part − time inside the prefill's forward calls: the export time the forward did
not hide (whole: read out of the pool + put; layerwise: waiting for the transfer thread + the
manifest) plus scheduling and sampling. On a shared CPU host the forward's own time swings by
seconds with the load, far more than the transfer, so ``tail`` is the column that shows the overlap.

Every sample uses a fresh random prompt (no prefix-cache hit), the modes alternate in order from
sample to sample, one warm-up sample per (backend, length, mode) is dropped, and each cell is the
median over ``--repeats``. ``--max-batched-tokens`` at least the prompt length runs the whole prompt
in one step (the case with the most layers to overlap); a smaller value makes it chunked prefill,
where only the last chunk's step exports. Torch runs one thread (as a worker does); the transfer
thread of the layerwise export can use a second core. The script starts its own ``redis-server``
on a free port of 127.0.0.1 and stops it by PID; without one, Redis is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import torch

from omnirelay.connectors import create_connector
from omnirelay.workers.llm.decode import DecodeEngine, DecodeTask
from omnirelay.workers.kv.cache import PagedKVCache
from omnirelay.workers.llm.model_runner import LocalRunner, local_runner
from omnirelay.workers.llm.models.llama import LlamaModel
from omnirelay.workers.llm.prefill import PrefillEngine, PrefillTask
from omnirelay.request_params import TextParams
from servers import start_redis, stop

MODES = ("whole", "layerwise")
PARAMS = TextParams(max_tokens=2, temperature=0, ignore_eos=True)   # first token + one decode token


class TimedForward:
    """Wraps a local runner's ``forward`` (an instance attribute, this benchmark only) and adds up
    the seconds spent inside it."""

    def __init__(self, runner):
        self.inner, self.seconds = runner.forward, 0.0
        runner.forward = self

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started


def one_sample(prefill: PrefillEngine, decode: DecodeEngine, prompt: list[int], rid: str,
               timer: TimedForward) -> tuple[float, float, float]:
    """(prefill seconds, decode seconds, prefill seconds outside the forward) from adding the prompt
    to the first decode token."""
    timer.seconds = 0.0
    t0 = time.perf_counter()
    prefill.add(PrefillTask(rid, prompt, PARAMS, time.time() + 600))
    results = []
    while not results:   # its first token comes early (not done); the done output with the hand-off after
        step = prefill.step()
        if step.failed:
            (failure,) = step.failed
            raise RuntimeError(f"prefill failed: {failure.error_type}: {failure.message}")
        results = [r for r in step.tokens if r.done]
    (result,) = results
    t1 = time.perf_counter()
    decode.add(DecodeTask(rid, prompt, result.token, PARAMS, time.time() + 600, "",
                          result.outputs.kv_key, result.outputs.kv_handle))
    tokens = []
    while not tokens:
        out = decode.step()
        if out.failed:
            raise RuntimeError(f"decode failed: {out.failed}")
        tokens = out.tokens
    t2 = time.perf_counter()
    while decode.has_work:   # max_tokens=2: the first decode token already finished it
        decode.step()
    return t1 - t0, t2 - t1, t1 - t0 - timer.seconds


def run_backend(model: LlamaModel, connector, lens: list[int], repeats: int, max_batched: int) -> list[dict]:
    cfg = model.config
    block = 16
    need_blocks = -(-(max(lens) + 2) // block) + 2
    kv_bytes = need_blocks * PagedKVCache.block_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block,
                                                      model.dtype)
    prefills = {mode: PrefillEngine(local_runner(model, block_size=block, budget_bytes=kv_bytes), connector,
                                    max_model_len=max(lens) + 8, max_batched_tokens=max_batched, prefix_caching=False,
                                    kv_transfer=mode) for mode in MODES}
    timers = {mode: TimedForward(engine.runner) for mode, engine in prefills.items()}
    cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=block, num_blocks=need_blocks,
                         dtype=model.dtype, device=model.device)
    decode = DecodeEngine(LocalRunner(model, cache), connector, max_num_seqs=4, max_model_len=max(lens) + 8)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in lens:
        samples = {mode: [] for mode in MODES}
        for i in range(repeats + 1):   # sample 0 of each mode warms pools and caches: dropped
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                prompt = torch.randint(10, cfg.vocab_size - 64, (n,), generator=gen).tolist()
                timing = one_sample(prefills[mode], decode, prompt, f"{mode}-{n}-{i}-{uuid.uuid4().hex[:6]}",
                                    timers[mode])
                if i:
                    samples[mode].append(timing)
        kv_mib = cfg.num_layers * 2 * n * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize / (1 << 20)
        row = {"prompt_tokens": n, "kv_mib": round(kv_mib, 1)}
        for mode in MODES:
            row[mode] = {"ttft_ms": 1e3 * statistics.median(p + d for p, d, _ in samples[mode]),
                         "prefill_ms": 1e3 * statistics.median(p for p, _, _ in samples[mode]),
                         "decode_ms": 1e3 * statistics.median(d for _, d, _ in samples[mode]),
                         "tail_ms": 1e3 * statistics.median(t for _, _, t in samples[mode]),
                         "samples_ttft_ms": [round(1e3 * (p + d), 1) for p, d, _ in samples[mode]]}
        rows.append(row)
        print(f"  {n} tokens: whole {row['whole']['ttft_ms']:.1f} ms, layerwise {row['layerwise']['ttft_ms']:.1f} ms",
              file=sys.stderr, flush=True)
    return rows


def table(results: dict) -> str:
    lines = ["| backend | prompt tokens | KV MiB | TTFT ms whole / layerwise | prefill ms whole / layerwise | "
             "tail ms whole / layerwise | decode ms whole / layerwise | tail + decode, layerwise / whole |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for backend, rows in results.items():
        for r in rows:
            w, lw = r["whole"], r["layerwise"]
            cells = [f"{w[k]:.1f} / {lw[k]:.1f}" for k in ("ttft_ms", "prefill_ms", "tail_ms", "decode_ms")]
            ratio = (lw["tail_ms"] + lw["decode_ms"]) / (w["tail_ms"] + w["decode_ms"])
            lines.append(f"| {backend} | {r['prompt_tokens']} | {r['kv_mib']} | {' | '.join(cells)} | {ratio:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="HF directory of a Llama/Qwen2 model (default: the tiny model)")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 2000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", nargs="+", default=["shared_memory", "redis"])
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--device", default="cpu", help="where both engines run: cpu, or cuda / cuda:N (the "
                    "connector's memory is the host's either way)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="omnirelay-kvbench-")
    redis_proc = None
    try:
        path = args.model
        if not path:
            from omnirelay.deploy.builders.llm import build_tiny_llm
            path = str(build_tiny_llm(os.path.join(work, "tiny-llm"), seed=0))
        model = LlamaModel(path, dtype=getattr(torch, args.dtype), device=args.device)
        results = {}
        for backend in args.backends:
            if backend == "redis":
                started = start_redis(work)
                if started is None:
                    print("redis: skipped (no redis-server)", file=sys.stderr)
                    continue
                redis_proc, url = started
                options = {"url": url, "prefix": f"kvbench-{uuid.uuid4().hex[:6]}:"}
            elif backend == "shared_memory":
                options = {"shm_dir": os.path.join(work, "shm")}
                os.makedirs(options["shm_dir"])
            else:
                options = {}
            print(f"{backend}:", file=sys.stderr, flush=True)
            connector = create_connector(backend, options)
            try:
                results[backend] = run_backend(model, connector, args.prompt_lens, args.repeats,
                                               args.max_batched_tokens)
            finally:
                connector.close()
            if redis_proc is not None:
                stop(redis_proc)
                redis_proc = None
        cfg = model.config
        print(f"Model: {path} ({cfg.num_layers} layers, {cfg.num_kv_heads} KV heads × {cfg.head_dim}, "
              f"{model.dtype}, on {model.device}); max_batched_tokens {args.max_batched_tokens}; "
              f"median of {args.repeats}; load average at the end {os.getloadavg()[0]:.1f}\n")
        print(table(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": path, "args": vars(args), "results": results}, f, indent=1)
    finally:
        if redis_proc is not None:
            stop(redis_proc)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
