"""Quantized weights served, against the same model in bf16: greedy agreement, output tok/s and
private memory, each variant under its own ``omni-serve`` on the same host, one after the other.

Variants (``--variants``): ``bf16`` (the checkpoint as stored), ``int8`` (``--quantization int8``:
quantized at load), ``w8a8`` (the checkpoint written by ``omni-make-model quantize --scheme W8A8``,
llm-compressor's format; built beside the model if missing).

For each: 8 chat prompts, 64 greedy tokens each (``return_token_ids``), sent at once (concurrency 8);
then the same batch timed ``--repeats`` times (output tok/s, median). Agreement of a variant with
bf16: prompts whose first token is the same, and the share of the 8 x 64 positions equal before the
first difference of each answer (a random-weight model at a real geometry: what the rounding does to
greedy choices, not answer quality), read against each variant's agreement with its own rerun (batch
shapes and prefix-cache hits change summation orders, so a rerun is not bit-identical either). Private memory: ``Private_Dirty`` summed over the server's
processes after the runs.

    python benchmarks/quantized_serving.py --model /tmp/q05b   # omni-make-model shape-qwen2.5-0.5b /tmp/q05b
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from servers import HttpServer, free_port  # noqa: E402

PROMPTS = ["Write a function that reverses a linked list.", "What is the capital of France?",
           "Explain how a transformer attends to earlier tokens.", "List five prime numbers.",
           "Tell me a short story about a lighthouse keeper.", "Summarise the plot of Hamlet in two sentences.",
           "How do I make a cup of green tea?", "Translate 'good morning' into French, German and Spanish."]


def ask(port: int, served: str, prompt: str, max_tokens: int) -> list[int]:
    body = json.dumps({"model": served, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "return_token_ids": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.loads(answer.read())["choices"][0]["token_ids"]


def batch(port: int, served: str, max_tokens: int) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: ask(port, served, p, max_tokens), PROMPTS))
    return answers, time.perf_counter() - start


def serve_variant(name: str, model: pathlib.Path, extra: list[str], args, work: pathlib.Path) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "omnirelay.deploy.serve", str(model), "--port", str(port), "--served-model-name",
           name, "--max-model-len", "1024", "--log-level", "INFO", *extra]
    server = HttpServer(name, cmd, port, name, work / f"{name}.log")
    try:
        ready = server.wait_ready(600)
        answers, _ = batch(port, name, args.max_tokens)   # warm-up, and the answers compared
        rates, reruns = [], []
        for _ in range(args.repeats):
            again, seconds = batch(port, name, args.max_tokens)
            reruns.append(again)
            rates.append(sum(map(len, again)) / seconds)
        memory = server.private_memory()
    finally:
        server.stop()
    return {"answers": answers, "rerun": reruns[-1], "tok_s": statistics.median(rates), "runs": rates, "ready_s": ready,
            "private_mib": {proc.split()[0] + " " + _role(proc): round(b / 2**20) for proc, b in memory.items()},
            "private_total_mib": round(sum(memory.values()) / 2**20)}


def _role(command: str) -> str:
    for role in ("prefill", "decode", "gateway", "broker"):
        if role in command:
            return role
    return "omni-serve"


def agreement(answers: list[list[int]], reference: list[list[int]]) -> dict:
    first = sum(a[0] == r[0] for a, r in zip(answers, reference))
    prefix = 0
    for a, r in zip(answers, reference):
        prefix += next((i for i, (x, y) in enumerate(zip(a, r)) if x != y), min(len(a), len(r)))
    total = sum(map(len, reference))
    return {"first_token_equal": f"{first}/{len(reference)}", "equal_prefix_share": round(prefix / total, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the bf16 model directory")
    ap.add_argument("--w8a8", default=None, help="its W8A8 copy (default: MODEL-w8a8, built if missing)")
    ap.add_argument("--variants", default="bf16,int8,w8a8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model = pathlib.Path(args.model).resolve()
    w8a8 = pathlib.Path(args.w8a8 or f"{model}-w8a8")
    variants = args.variants.split(",")
    if "w8a8" in variants and not w8a8.exists():
        subprocess.run([sys.executable, "-m", "omnirelay.deploy.builders.llm", "quantize", str(model), str(w8a8)],
                       check=True)
    setups = {"bf16": (model, []), "int8": (model, ["--quantization", "int8"]), "w8a8": (w8a8, [])}
    results = {"machine": {"cpu": os.cpu_count(), "load_before": os.getloadavg()}, "variants": {}}
    with tempfile.TemporaryDirectory(prefix="quantized-serving-") as work:
        for name in variants:
            path, extra = setups[name]
            results["variants"][name] = serve_variant(name, path, extra, args, pathlib.Path(work))
            print(f"{name}: {results['variants'][name]['tok_s']:.1f} tok/s, private "
                  f"{results['variants'][name]['private_total_mib']} MiB {results['variants'][name]['private_mib']}",
                  flush=True)
    results["machine"]["load_after"] = os.getloadavg()
    reference = results["variants"].get("bf16", {}).get("answers")
    # A rerun of the same prompts is not bit-identical either (other batch shapes, prefix-cache hits:
    # other summation orders): bf16 against its own rerun is the floor the variants are read against.
    print("| variant | output tok/s (median) | private MiB (total) | first token = bf16 | equal prefix share "
          "| vs its own rerun |")
    print("|---|---|---|---|---|---|")
    for name, got in results["variants"].items():
        agree = agreement(got["answers"], reference) if reference else {}
        own = agreement(got["rerun"], got["answers"])
        got["agreement"], got["self_agreement"] = agree, own
        print(f"| {name} | {got['tok_s']:.1f} | {got['private_total_mib']} | {agree.get('first_token_equal', '-')} "
              f"| {agree.get('equal_prefix_share', '-')} | {own['first_token_equal']}, {own['equal_prefix_share']} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
