"""``omni-plan profile``: measure a :class:`~omnirelay.fleet.planner.Profile` against a running gateway.

Short runs through the official ``openai`` client (streamed chat completions, greedy, ``ignore_eos``
so every request produces ``--output-len`` tokens), with the fleet's size read from ``/cluster``:

1. prefill latency: the median time to first token of ``--samples`` requests sent one at a time;
2. prefill throughput: a burst of ``--burst`` requests of the workload (``--output-len`` tokens:
   on a host whose cores the workers share, decode steps take cores prefill would otherwise have;
   one-token requests measured 38/s where the workload's own got < 27/s) at a concurrency of
   twice the prefill fleet's capacity; completions per second are recorded for the fleet's prefill count in
   ``prefill_rps_by_workers`` and, divided by it, give ``prefill_rps``. Workers sharing a host's
   cores do not add up (see :mod:`.planner`): run the profile against 1, 2, … prefill workers with
   ``--merge`` to give the planner the host's measured curve;
3. decode: the ITL p90 (gaps between streamed chunks, as ``vllm bench serve`` counts them) with one
   stream per decode worker and with each worker full (its capacity), fitted to itl(B) = a + b·B.

Encode and generate figures are not measured here (the bundled tiny LLM has neither role); give
them in the JSON by hand for a pipeline that has them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time

import openai

from .planner import Profile
from .signals import GatewayProbe


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


async def _stream(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, chunk arrival times) of one streamed request."""
    start = time.perf_counter()
    times: list[float] = []
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  temperature=0, max_tokens=max_tokens, stream=True,
                                                  extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
    if not times:
        raise RuntimeError("a profiling request produced no tokens")
    return times[0] - start, times


async def _concurrent(client, model: str, prompt: str, max_tokens: int, n: int, concurrency: int):
    semaphore = asyncio.Semaphore(concurrency)

    async def one(i: int):
        async with semaphore:
            return await _stream(client, model, f"{prompt} ({i})", max_tokens)
    return await asyncio.gather(*(one(i) for i in range(n)))


def _fleet(url: str, model: str, api_key: str | None) -> tuple[list[dict], list[dict]]:
    workers = GatewayProbe(url, api_key).cluster()["workers"]
    prefill = [w for w in workers if w["model"] == model and w["role"] == "prefill"]
    decode = [w for w in workers if w["model"] == model and w["role"] == "decode"]
    if not prefill or not decode:
        raise RuntimeError(f"{url} has no prefill or no decode worker for {model!r}")
    return prefill, decode


def _prompt(input_len: int) -> str:
    return " ".join(["word"] * max(1, input_len - 8))


async def _prefill_burst(client, model: str, prompt: str, output_len: int, burst: int, prefill: list[dict]) -> float:
    """Completions per second of the whole prefill fleet, kept busy (twice its capacity in flight)."""
    start = time.perf_counter()
    await _concurrent(client, model, prompt, output_len, burst, 2 * sum(w["capacity"] for w in prefill))
    return burst / (time.perf_counter() - start)


async def measure_prefill_throughput(url: str, model: str, input_len: int, output_len: int, burst: int,
                                     api_key: str | None = None) -> tuple[int, float]:
    """(prefill workers, requests per second they complete together): one point of the host's curve."""
    prefill, _ = _fleet(url, model, api_key)
    prompt = _prompt(input_len)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key or "unused", max_retries=0,
                                  timeout=300) as client:
        await _concurrent(client, model, prompt, 1, 2 * len(prefill), len(prefill))   # warm-up, every worker
        return len(prefill), await _prefill_burst(client, model, prompt, output_len, burst, prefill)


async def measure(url: str, model: str, input_len: int, output_len: int, samples: int, burst: int,
                  api_key: str | None = None) -> Profile:
    prefill, decode = _fleet(url, model, api_key)
    capacity = min(w["capacity"] for w in decode)
    prompt = _prompt(input_len)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key or "unused", max_retries=0,
                                  timeout=300) as client:
        await _concurrent(client, model, prompt, 4, 2, 1)     # warm-up: compile paths, caches
        ttfts = [ttft for ttft, _ in await _concurrent(client, model, prompt, 2, samples, 1)]
        fleet_rps = await _prefill_burst(client, model, prompt, output_len, burst, prefill)
        prefill_rps = fleet_rps / len(prefill)
        itl = {}
        for per_worker in sorted({1, capacity}):
            streams = per_worker * len(decode)
            runs = await _concurrent(client, model, prompt, output_len, max(streams, 2 * streams), streams)
            gaps = [b - a for _, times in runs for a, b in zip(times, times[1:])]
            itl[per_worker] = _p90(gaps)
    slope = (itl[capacity] - itl[1]) / (capacity - 1) if capacity > 1 else 0.0
    slope = max(0.0, slope)
    return Profile(prefill_rps=prefill_rps, prefill_s=statistics.median(ttfts), itl_base_s=max(1e-6, itl[1] - slope),
                   itl_per_seq_s=slope, decode_capacity=capacity, prefill_rps_by_workers={len(prefill): fleet_rps})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-plan profile", description=__doc__.split("\n")[0])
    parser.add_argument("--gateway", required=True)
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--input-len", type=int, default=64, help="prompt length in words (~tokens)")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--burst", type=int, default=32)
    parser.add_argument("--merge", default=None, metavar="PROFILE",
                        help="a profile of the same host with another prefill count: keep its figures and add "
                             "this fleet's prefill throughput to its prefill_rps_by_workers")
    parser.add_argument("--out", default="-", help="where the profile JSON goes (default: stdout)")
    args = parser.parse_args(argv)
    if args.merge:
        with open(args.merge) as handle:
            profile = Profile.from_json(json.load(handle))
        workers, rps = asyncio.run(measure_prefill_throughput(args.gateway, args.model, args.input_len,
                                                              args.output_len, args.burst, args.api_key))
        profile = dataclasses.replace(profile, prefill_rps_by_workers={**profile.prefill_rps_by_workers,
                                                                       workers: rps})
    else:
        profile = asyncio.run(measure(args.gateway, args.model, args.input_len, args.output_len, args.samples,
                                      args.burst, args.api_key))
    text = json.dumps(profile.to_json(), indent=1)
    if args.out == "-":
        print(text)
    else:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    return 0
