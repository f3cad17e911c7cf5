"""Engine step times without a server: a batched decode step and a 16-prompt prefill, one torch thread.

What is measured (interleaved, ``--repeats`` times; minimum and median reported):

* decode step: 16 sequences of 128–173 cached tokens, one new token each, through
  :meth:`LlamaModel.decode` over a paged KV cache — with the native attention kernel and with the
  torch path (``attention="torch"``);
* prefill: the same 16 prompts in one packed :meth:`LlamaModel.forward`.

``--baseline-rev REV`` adds the same two measurements for ``workers/llm/models/llama.py`` and
``workers/kv/cache.py`` as they were at git revision REV (e.g. ``e72d9c0``, the first vertical slice:
prefill one prompt at a time into a contiguous KV, decode gathering blocks with advanced indexing),
loaded from ``git show`` into a temporary directory.

Usage::

    python benchmarks/engine_step.py [--model DIR] [--baseline-rev e72d9c0] [--repeats 7]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent


def _load_baseline(rev: str, tmp: pathlib.Path):
    """The model and cache modules at ``rev`` (both import only torch, safetensors and the stdlib)."""
    mods = {}
    for name, path in (("base_llama", "workers/llm/models/llama.py"), ("base_kv_cache", "workers/kv/cache.py")):
        src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], check=True, capture_output=True,
                             text=True).stdout
        file = tmp / f"{name}.py"
        file.write_text(src)
        spec = importlib.util.spec_from_file_location(name, file)
        mods[name] = importlib.util.module_from_spec(spec)
        sys.modules[name] = mods[name]   # dataclasses look their module up while the class is built
        spec.loader.exec_module(mods[name])
    return mods["base_llama"], mods["base_kv_cache"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=pathlib.Path, help="HF directory (default: the tiny built-in model)")
    ap.add_argument("--baseline-rev", default="")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from omnirelay.workers.llm.forward_batch import ForwardBatch
    from omnirelay.workers.kv.cache import PagedKVCache
    from omnirelay.workers.llm.models.llama import LlamaModel
    if args.model is None:
        from omnirelay.deploy.builders.llm import default_model_dir
        args.model = default_model_dir()
    model = LlamaModel(args.model)
    plain = LlamaModel(args.model, attention="torch")
    cfg = model.config
    batch = args.batch
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, min(cfg.vocab_size, 1000), (128 + 3 * i,), generator=gen).tolist() for i in range(batch)]
    cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=batch * 13 + 1)
    blocks = [cache.allocator.allocate(cache.blocks_needed(200)) for _ in range(batch)]
    tables = torch.tensor(blocks)
    positions = torch.tensor([len(p) for p in prompts])
    ids = torch.randint(0, min(cfg.vocab_size, 1000), (batch,), generator=gen)

    def prefill_new():
        model.forward(ForwardBatch.build([(p, 0, b) for p, b in zip(prompts, blocks)], cache.block_size), cache)

    cases = {"decode step (native attention)": lambda: model.decode(ids, positions, cache, tables),
             "decode step (torch attention)": lambda: plain.decode(ids, positions, cache, tables),
             f"prefill {batch} prompts (one packed forward)": prefill_new}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline_rev:
            base_llama, base_kv = _load_baseline(args.baseline_rev, pathlib.Path(tmp))
            old = base_llama.LlamaModel(args.model)
            old_cache = base_kv.PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                             num_blocks=batch * 13 + 1)

            def prefill_old():
                for p, b in zip(prompts, blocks):
                    _, kv = old.prefill(p)
                    old_cache.write_sequence(b, kv)

            cases[f"decode step, {args.baseline_rev}"] = lambda: old.decode(ids, positions, old_cache, tables,
                                                                               positions + 1)
            cases[f"prefill {batch} prompts, {args.baseline_rev} (one at a time)"] = prefill_old
            prefill_old()
        prefill_new()
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, fn in cases.items():
                n = 10 if name.startswith("decode") else 1
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                times[name].append((time.perf_counter() - start) / n * 1e3)
    print(f"model {args.model}, batch {batch}, {args.repeats} repeats, 1 thread")
    for name, values in times.items():
        values.sort()
        print(f"{name:55s} min {values[0]:9.2f} ms   median {values[len(values) // 2]:9.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
