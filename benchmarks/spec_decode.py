"""Speculative decoding (ngram) vs none: omni-serve under a copy-heavy load, one server at a time.

For each setting (``off``, then each ``--speculative-config`` given), omni-serve starts on a free
port, serves one unmeasured warm-up pass, then two measured passes of the same prompts through the
official ``openai`` client (streaming, ``ignore_eos``, greedy, ``return_token_ids``):

* concurrency 1: each request's inter-token latency, ``(E2E - TTFT) / (tokens - 1)`` (tokens that
  arrive together count as the gaps they replace); the median over requests;
* concurrency 16: output tokens per second of the pass (every prompt at once, 16 in flight).

Then the server's ``/metrics`` give the acceptance (vLLM's ``spec_decode`` counters), the server is
stopped by its process group, and the next setting starts. Greedy outputs are compared token for
token against ``off`` in every cell; a difference fails the run.

Copy-heavy prompts: code to edit, a passage to quote. The tiny random models do not follow the
instruction; they fall into repeating their own output, which prompt lookup drafts just as well,
so the acceptance rate on them says how repetitive that model's text is, not how often a real
model quotes its prompt.

Usage::

    omni-make-model tiny-llm /tmp/specbench/tiny-llm
    python benchmarks/spec_decode.py /tmp/specbench/tiny-llm --work-dir /tmp/specbench \\
        --spec '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import re
import statistics
import sys
import time
import urllib.request

import openai

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from servers import HttpServer, free_port  # noqa: E402

CODE = ("def parse_header(line):\n    key, _, value = line.partition(':')\n    return key.strip().lower(), "
        "value.strip()\n\n\ndef parse_headers(lines):\n    headers = {}\n    for line in lines:\n        key, "
        "value = parse_header(line)\n        headers[key] = value\n    return headers\n")
PASSAGE = ("The river rose in the night and by morning the lower fields were under water; the farmers moved "
           "their animals to the ridge, and the miller opened every gate of the weir to let the flood pass.")
PROMPTS = [f"Rename parse_header to split_header everywhere and return the whole file:\n{CODE}",
           f"Quote this passage exactly, then quote it again:\n{PASSAGE}",
           f"Add type hints to every function and repeat the code:\n{CODE}",
           f"Repeat word for word: {PASSAGE}"]


async def one(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first = None
    tokens: list[int] = []
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens,
        stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    async for chunk in stream:
        if chunk.choices and (chunk.choices[0].model_extra or {}).get("token_ids"):
            first = first or time.perf_counter()
            tokens += chunk.choices[0].model_extra["token_ids"]
    end = time.perf_counter()
    return {"tokens": tokens, "ttft": first - start, "itl": (end - first) / max(len(tokens) - 1, 1), "e2e": end - start}


async def run_pass(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[list, float]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    slots = asyncio.Semaphore(concurrency)

    async def limited(prompt):
        async with slots:
            return await one(client, model, prompt, max_tokens)

    start = time.perf_counter()
    results = await asyncio.gather(*(limited(p) for p in prompts))
    elapsed = time.perf_counter() - start
    await client.close()
    return results, elapsed


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def setting(label: str, spec: str | None, args, work: pathlib.Path) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "omnirelay.deploy.serve", args.model, "--served-model-name", "bench",
           "--port", str(port), "--log-level", "WARNING", *(["--speculative-config", spec] if spec else [])]
    server = HttpServer(label, cmd, port, "bench", work / f"serve-{label}.log")
    try:
        server.wait_ready(300)
        one_prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests_c1)]
        many_prompts = [PROMPTS[i % len(PROMPTS)] + f"\n(copy {i})" for i in range(args.requests_c16)]
        asyncio.run(run_pass(server.url, "bench", PROMPTS, 4, 16))   # warm-up, unmeasured
        c1, _ = asyncio.run(run_pass(server.url, "bench", one_prompts, 1, args.max_tokens))
        c16, elapsed = asyncio.run(run_pass(server.url, "bench", many_prompts, 16, args.max_tokens))
        drafted = metric(server.url, "vllm:spec_decode_num_draft_tokens_total")
        accepted = metric(server.url, "vllm:spec_decode_num_accepted_tokens_total")
        drafts = metric(server.url, "vllm:spec_decode_num_drafts_total")
    finally:
        server.stop()
    return {"label": label, "spec": spec, "itl_ms_c1": 1000 * statistics.median(r["itl"] for r in c1),
            "tok_s_c16": sum(len(r["tokens"]) for r in c16) / elapsed,
            "acceptance": accepted / drafted if drafted else None,
            "accepted_per_draft": accepted / drafts if drafts else None,
            "outputs": [r["tokens"] for r in c1 + c16]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--work-dir", default="/tmp/specbench")
    parser.add_argument("--spec", action="append", default=[], help="a --speculative-config to compare with off")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-c1", type=int, default=8)
    parser.add_argument("--requests-c16", type=int, default=32)
    args = parser.parse_args(argv)
    work = pathlib.Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    rows = [setting("off", None, args, work)]
    rows += [setting(f"spec{i}", spec, args, work) for i, spec in enumerate(args.spec, 1)]
    base = rows[0]
    print("| setting | ITL p50 c=1 (ms) | vs off | output tok/s c=16 | vs off | acceptance | accepted/draft | greedy equal |")
    print("|---|---|---|---|---|---|---|---|")
    failed = False
    for row in rows:
        equal = row["outputs"] == base["outputs"]
        failed |= not equal
        acc = "—" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        per = "—" if row["accepted_per_draft"] is None else f"{row['accepted_per_draft']:.2f}"
        print(f"| {row['spec'] or 'off'} | {row['itl_ms_c1']:.1f} | {base['itl_ms_c1'] / row['itl_ms_c1']:.2f}x "
              f"| {row['tok_s_c16']:.0f} | {row['tok_s_c16'] / base['tok_s_c16']:.2f}x | {acc} | {per} | "
              f"{'yes' if equal else 'NO'} |")
    (work / "results.json").write_text(json.dumps(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
