"""A decode step at a real layer geometry, broken down by op: where a step's time goes.

The model: ``--model DIR`` (default: ``omni-make-model shape-qwen2.5-0.5b``'s Qwen2.5-0.5B geometry
in bf16, built once into the cache). For each dtype (bf16 and float32) and each engine path — the
fast one (linears packed for oneDNN, decode attention read from the paged pool in place by the
native kernel) and the plain one (``F.linear``, gather + SDPA with a mask) — it times
``--steps`` decode steps of ``--batch`` sequences whose contexts are ``--context`` tokens (plus a
few, so lengths differ), on ``--threads`` torch threads, then profiles a few more steps with
``torch.profiler`` and splits each step into:

* ``linears``: the layers' projections (q/k/v, o, gate/up, down);
* ``lm_head``: the vocabulary projection of each sequence's last token;
* ``attention``: decode attention (the native kernel, or the gather + SDPA);
* ``kv write``: the new tokens' K/V into their cache slots;
* ``other ops``: norms, rotary, SwiGLU, residual adds, embedding;
* ``python``: the step's wall time not spent inside any op (the interpreter between ops).

The shares come from the profiled steps (the profiler adds overhead to each op, so absolute
profiled times are higher); the step time is the unprofiled median. vLLM-CPU's TPOT on the same
model comes from ``benchmarks/serve_vs_vllm.py`` (its server does not expose a step profile).

``--device cuda`` runs the same steps on ``cuda:0`` (the fast and plain paths are one there: no
packing, no native kernel; run ``--paths fast``): the step time then waits for the device, and each
row adds the host's issue time per step (the step's Python and launches, without waiting), the GPU's
kernel time per step and the attention kernels that ran, from the profiler's CUDA activity.

Usage::

    python benchmarks/decode_profile.py [--model DIR] [--batch 8] [--context 256] [--threads 1]
                                        [--device cpu|cuda] [--paths fast,plain]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent


def _categorise(name: str) -> str:
    if name.startswith("bench::"):
        return name[len("bench::"):]
    if "linear" in name or name in ("aten::addmm", "aten::mm", "aten::matmul"):
        return "linears"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    return "other ops"


def _instrument(model, cache) -> None:
    """Label the lm_head, the native kernel, the gather and the KV write as profiler ranges (on this
    benchmark's objects only; the engine's hot path carries no profiling hooks)."""
    record = torch.profiler.record_function
    logits, write = model._logits, cache.write

    def labelled_logits(h):
        with record("bench::lm_head"):
            return logits(h)

    def labelled_write(*args):
        with record("bench::kv write"):
            return write(*args)

    model._logits, cache.write = labelled_logits, labelled_write
    if model._native is not None:
        native = model._native

        def labelled_native(*args):
            with record("bench::attention"):
                return native(*args)

        model._native = labelled_native
    else:
        gather = cache.gather

        def labelled_gather(*args):
            with record("bench::attention"):
                return gather(*args)

        cache.gather = labelled_gather


def measure(path: pathlib.Path, dtype: torch.dtype, fast: bool, batch: int, context: int, steps: int,
            device: str = "cpu") -> dict:
    from omnirelay.workers.kv.cache import PagedKVCache
    from omnirelay.workers.llm.forward_batch import ForwardBatch
    from omnirelay.workers.llm.models.llama import LlamaModel

    options = {} if fast else {"attention": "torch", "kernels": "torch"}
    model = LlamaModel(path, dtype=dtype, device=device, **options)
    cfg = model.config
    cuda = model.device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    lengths = [context + 3 * i for i in range(batch)]
    block = 16
    need = [-(-(n + steps + 16) // block) for n in lengths]
    cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=block,
                         num_blocks=sum(need) + 1, dtype=dtype, device=model.device)
    blocks = [cache.allocator.allocate(n) for n in need]
    # The pool holds random K/V: a decode step's cost does not depend on what the keys say.
    pool_gen = torch.Generator(device=model.device).manual_seed(0)
    for keys, values in zip(cache.keys, cache.values):
        keys.normal_(generator=pool_gen)
        values.normal_(generator=pool_gen)
    width = max(need)
    tables = torch.tensor([b + [0] * (width - len(b)) for b in blocks])
    ids = torch.randint(0, 1000, (batch,), generator=gen)
    positions = torch.tensor(lengths)

    def step():
        model.forward(ForwardBatch.decode(ids, positions, tables, block).to(model.device), cache)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        step()
    sync()
    times, issue = [], []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        issue.append((time.perf_counter() - start) * 1e3)
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    _instrument(model, cache)
    profiled = 5
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(profiled):
            step()
        sync()
        wall = (time.perf_counter() - start) * 1e6
    spent: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue   # a kernel on the device: counted below, on the GPU's own clock
        if event.cpu_parent is not None and not event.cpu_parent.name.startswith("bench::"):
            continue   # counted in its parent
        if event.cpu_parent is not None:
            continue   # inside a labelled range: the range counts it
        spent[_categorise(event.name)] = spent.get(_categorise(event.name), 0.0) + event.cpu_time_total
    spent["python"] = max(wall - sum(spent.values()), 0.0)
    total = sum(spent.values())
    row = {"dtype": str(dtype).replace("torch.", ""), "path": "fast" if fast else "plain",
           "device": str(model.device), "batch": batch, "context": context,
           "step_ms_median": round(statistics.median(times), 2), "step_ms_min": round(min(times), 2),
           "share": {k: round(v / total, 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}}
    if cuda:
        kernels = [a for a in prof.key_averages() if a.self_device_time_total > 0]
        row["host_issue_ms_median"] = round(statistics.median(issue), 2)
        row["gpu_ms_per_step"] = round(sum(a.self_device_time_total for a in kernels) / profiled / 1e3, 3)
        row["attention_kernels"] = sorted({a.key[:80] for a in kernels if any(
            w in a.key.lower() for w in ("flash", "fmha", "attention", "efficient"))})
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=pathlib.Path, help="HF directory (default: the 0.5B-geometry bf16 model)")
    ap.add_argument("--batch", default="8", help="sequences per step; a comma list times each (e.g. 1,8)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N")
    ap.add_argument("--paths", default="fast,plain", help="engine paths to time: fast, plain or both")
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from omnirelay.deploy.builders.llm import cached_model, is_complete, _build_real_shape_into
        args.model = cached_model("shape-qwen2.5-0.5b-seed0", lambda tmp: _build_real_shape_into(tmp, 0), is_complete)
    rows = []
    for batch in [int(b) for b in args.batch.split(",")]:
        for name in args.dtypes.split(","):
            for fast in [p == "fast" for p in args.paths.split(",")]:
                rows.append(measure(args.model, getattr(torch, name), fast, batch, args.context, args.steps,
                                    args.device))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    cats = ["linears", "lm_head", "attention", "kv write", "other ops", "python"]
    print(f"model {args.model}, batch {args.batch}, context ~{args.context}, {args.threads} thread(s), {args.device}")
    print("| batch | dtype | path | step ms (median) | " + " | ".join(cats) + " |")
    print("|---|---|---|---|" + "---|" * len(cats))
    for r in rows:
        print(f"| {r['batch']} | {r['dtype']} | {r['path']} | {r['step_ms_median']} | "
              + " | ".join(f"{100 * r['share'].get(c, 0):.0f} %" for c in cats) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
