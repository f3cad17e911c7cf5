"""Qwen3-MoE step times on one rank, on two tensor ranks (every expert sliced) and on two ranks with
expert parallelism (whole experts per rank, tokens by all-to-all), plus greedy parity between them.

What is measured (the same batches on every layout, one layout after the other since a process
holds one torch.distributed group at a time; one warm-up round, then ``--repeats``; median and
minimum reported, in ms):

* prefill: ``--prompts`` prompts of ``--prompt-len`` tokens in one packed forward;
* decode: the same sequences, one new token each, against their cached prompts.

Parity: the greedy next token of every sequence after prefill and after decode must be the same on
every layout (exit status 1 otherwise), and on one rank equal to transformers' when ``--check-hf``.

Devices: ``--devices cpu`` (gloo, default) or ``--devices cuda`` (rank ``i`` on ``cuda:i``, NCCL
between them; the group layouts need two GPUs and are skipped, saying so, with one).

Usage::

    python benchmarks/moe_step.py [--model DIR] [--repeats 5] [--devices cpu|cuda] [--json out.json]
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


def _batches(vocab: int, prompts: int, prompt_len: int, block_size: int):
    from omnirelay.workers.llm.forward_batch import ForwardBatch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab - 64, (prompts, prompt_len), generator=gen).tolist()
    per_seq = -(-(prompt_len + 1) // block_size)
    blocks = [list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(prompts)]
    prefill = ForwardBatch.build([(p, 0, b) for p, b in zip(ids, blocks)], block_size)
    tables = torch.tensor(blocks, dtype=torch.long)
    positions = torch.full((prompts,), prompt_len, dtype=torch.long)

    def decode(tokens: list[int]) -> ForwardBatch:
        return ForwardBatch.decode(torch.tensor(tokens, dtype=torch.long), positions, tables, block_size)

    return prefill, decode, 1 + prompts * per_seq


def _time(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return (time.perf_counter() - start) * 1000, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=pathlib.Path, help="Qwen3-MoE directory (default: the cached tiny-qwen3-moe)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--devices", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--check-hf", action="store_true", help="also compare one rank's tokens with transformers")
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from omnirelay.deploy.builders.qwen3 import cached_qwen3
    from omnirelay.workers.kv.cache import PagedKVCache
    from omnirelay.workers.llm.model_runner import LocalRunner
    from omnirelay.workers.llm.models.llama import LlamaModel
    from omnirelay.workers.llm.parallel import GroupConfig, GroupRunner

    model_dir = str(args.model or cached_qwen3(moe=True))
    cuda = args.devices == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    block_size = 16
    model = LlamaModel(model_dir, device="cuda:0" if cuda else "cpu")
    cfg = model.config
    prefill, decode, num_blocks = _batches(cfg.vocab_size, args.prompts, args.prompt_len, block_size)
    skipped = {}
    gpus = torch.cuda.device_count() if cuda else 0
    names = ["1 rank", "TP=2", "TP=2 EP=2"]
    if cuda and gpus < 2:
        skipped = {name: f"needs 2 GPUs, {gpus} visible" for name in names[1:]}
        names = names[:1]
    times: dict[str, dict[str, list[float]]] = {}
    tokens: dict[str, list[list[int]]] = {}
    for name in names:   # one group at a time: a process holds one default process group
        if name == "1 rank":
            runner = LocalRunner(model, PagedKVCache(len(model.layers), model.num_kv_heads, cfg.head_dim,
                                                     block_size=block_size, num_blocks=num_blocks, device=model.device))
        else:
            runner = GroupRunner(GroupConfig(model_dir, tp_size=2, block_size=block_size, num_blocks=num_blocks,
                                             threads=args.threads, devices=("cuda:0", "cuda:1") if cuda else (),
                                             expert_parallel=name.endswith("EP=2")))
        times[name] = {"prefill": [], "decode": []}
        try:
            for repeat in range(args.repeats + 1):   # the first round warms up and is not counted
                ms_prefill, logits = _time(lambda: runner.forward(prefill), sync)
                first = logits.argmax(-1).tolist()
                ms_decode, logits = _time(lambda: runner.forward(decode(first)), sync)
                tokens[name] = [first, logits.argmax(-1).tolist()]
                if repeat:
                    times[name]["prefill"].append(ms_prefill)
                    times[name]["decode"].append(ms_decode)
        finally:
            runner.close()
    reference = tokens["1 rank"]
    parity = {name: got == reference for name, got in tokens.items()}
    if args.check_hf:
        parity["transformers"] = _hf_tokens(model_dir, prefill, args) == reference
    result = {"model": model_dir, "devices": args.devices, "prompts": args.prompts, "prompt_len": args.prompt_len,
              "repeats": args.repeats, "parity": parity, "skipped": skipped,
              "ms": {name: {kind: {"median": round(statistics.median(v), 2), "min": round(min(v), 2)}
                            for kind, v in t.items()} for name, t in times.items()}}
    print(json.dumps(result, indent=2))
    print("\n| layout | prefill ms (median / min) | decode step ms (median / min) | parity |\n|---|---|---|---|")
    for name, t in result["ms"].items():
        print(f"| {name} | {t['prefill']['median']} / {t['prefill']['min']} | "
              f"{t['decode']['median']} / {t['decode']['min']} | {'ok' if parity[name] else 'MISMATCH'} |")
    for name, why in skipped.items():
        print(f"| {name} | skipped: {why} | | |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(parity.values()) else 1


def _hf_tokens(model_dir: str, prefill, args) -> list[list[int]]:
    """transformers' greedy first two tokens of the same prompts (one sequence at a time)."""
    from transformers import AutoModelForCausalLM

    device = "cuda:0" if args.devices == "cuda" else "cpu"   # same device: same kernels as ours
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    prompts = prefill.input_ids.view(args.prompts, args.prompt_len).to(device)
    with torch.no_grad():
        out = hf.generate(prompts, max_new_tokens=2, min_new_tokens=2, do_sample=False)[:, args.prompt_len:]
    return [out[:, 0].tolist(), out[:, 1].tolist()]


if __name__ == "__main__":
    sys.exit(main())
