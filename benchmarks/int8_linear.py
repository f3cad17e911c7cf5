"""The linear kernels a quantized model can run, side by side at Qwen2.5-0.5B's shapes: ms for eight
distinct weights (so they are read from memory, not cache), one thread.

* ``bf16 packed``: the bf16 weight in oneDNN's blocked layout (the decode role's float kernel);
* ``bf16 F.linear``: the bf16 weight as stored (the prefill role's float kernel);
* ``int8 packed``: :class:`Int8Linear` with fbgemm's packed weights (the decode role's int8 kernel);
* ``int8 mapped``: :class:`Int8Linear` on the int8 tensors in place, ``torch._int_mm`` (the prefill role's).

    python benchmarks/int8_linear.py [--rows 1,8,64,256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from omnirelay.workers.llm.quantization import Int8Linear, quantize_per_channel

SHAPES = {"gate_up 9728x896": (9728, 896), "down 896x4864": (896, 4864)}
COPIES = 8


def timed(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,64,256")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"one thread, load average {os.getloadavg()[0]:.2f}, ms for {COPIES} distinct weights")
    print("| weight | M | bf16 packed | bf16 F.linear | int8 packed | int8 mapped |")
    print("|---|---|---|---|---|---|")
    for label, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(COPIES)]
        bf16 = [w.bfloat16() for w in weights]
        packed_bf16 = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in bf16]
        quantized = [quantize_per_channel(w) for w in weights]
        packed_int8 = [Int8Linear([q], None, packed=True) for q in quantized]
        mapped_int8 = [Int8Linear([q], None, packed=False) for q in quantized]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=gen).bfloat16()
            row = {
                "bf16 packed": timed(lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                              for w in packed_bf16]),
                "bf16 F.linear": timed(lambda: [F.linear(x, w) for w in bf16]),
                "int8 packed": timed(lambda: [linear(x) for linear in packed_int8]),
                "int8 mapped": timed(lambda: [linear(x) for linear in mapped_int8]),
            }
            print(f"| {label} | {m} | " + " | ".join(f"{v:.1f}" for v in row.values()) + " |", flush=True)
            print(json.dumps({"weight": label, "rows": m, **{k: round(v, 2) for k, v in row.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
