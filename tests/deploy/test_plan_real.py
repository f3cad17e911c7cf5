"""omni-plan checked against a real run on this host: profile the fleet through the gateway, plan
the fleet for a request rate and SLO, start it, and measure: the planned fleet meets the SLO it was
planned for, and one worker fewer of the bottleneck role does not.

Real broker, gateway and workers; open-loop Poisson arrivals through the official ``openai`` client.

On a host with few cores (2 here and on CI) the workers are not the independent servers the
planner first assumed: broker, gateway, this client and every worker share the cores, so a second
prefill worker adds what the first left idle, not a worker's worth. With throughput assumed linear
(2 × one worker's) the plan was wrong on 2 cores: TTFT p90 3.4 s against a 2.4 s SLO with the
planned two prefill workers (2026-12-04). So the planner takes the host's *measured* curve: the
profile measures the prefill throughput with one worker and again with two
(``prefill_rps_by_workers``), and the planner serves each worker at its share of the measured
total and assumes no gain beyond the largest count measured (see omnirelay.fleet.planner). The
rate is then chosen from the measurements: above what one prefill worker completes (so one fewer
cannot keep up and its queue grows for the whole run), and below what two complete at the planner's
``max_utilisation``. Each worker runs one torch thread (``OMP_NUM_THREADS=1``), as a CPU deployment
gives each worker its share of the cores: with torch's default (a thread per core in every worker)
two workers oversubscribe the cores and a second one adds little.

What this host can and cannot show (2026-12-05, 2 cores shared with other sessions' tests, load
average 5-15): the curve itself moves with the host's other load. A prefill worker at capacity 1
is held by round trips (gateway → broker → worker → decode), not only by its own CPU (0.39 of a
core at 20 requests/s), so under other load a second worker overlaps those waits (1.5-1.75× one
worker), while in a quieter minute one worker reached 27/s and a second added 1 % — then the
test fails at its first check (a second worker must add > 10 % at max_utilisation) rather than
plan a fleet the host cannot tell apart. The profile's bursts are the workload's own requests
(prompt and output length): one-token bursts left the decode steps' share of the cores out and
measured 24.6 → 38.1/s, and the fleet planned from them missed (2.8 s against a 1.07 s SLO).
Runs with the workload's bursts: curve 12.5 → 19.7/s, rate 13.97/s, planned 2P+1D TTFT p90 695 ms
(100 % within the 1,050 ms SLO), one fewer 1 % within (181 of 421 shed as overloaded); curve
6.9 → 12.5/s, rate 8.20/s, planned 231 ms (100 % within 2,980 ms), one fewer 3,765 ms (64 %)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time

import openai
import pytest

from cluster import Cluster
from omnirelay.fleet.planner import Slo, Workload, plan
from omnirelay.fleet.profile import measure, measure_prefill_throughput

# A measurement of this host, not a property of the code: whether a second prefill worker adds
# throughput depends on what else the cores run that minute, so it is its own tier (`pytest -m
# measure`), run by hand like the benchmarks, and out of the default and slow tiers CI runs.
pytestmark = pytest.mark.measure

# ~1,800 prompt tokens: a prefill slow enough that the client keeps up; two output tokens keep decode
# (which shares the same cores, and which the planner sizes alone) at one worker and a small batch.
INPUT_WORDS, OUTPUT_LEN, RUN_S = 900, 2, 30.0


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _attained(ttfts: list[float], failed: int, slo_s: float) -> float:
    """Share of requests whose TTFT met ``slo_s`` (a failed one did not); a p90 SLO needs 90 %."""
    return sum(t <= slo_s for t in ttfts) / max(1, len(ttfts) + failed)


async def _open_loop(url: str, rate: float, duration_s: float) -> tuple[list[float], list[float], int, float]:
    """Poisson arrivals at ``rate`` for ``duration_s``: (TTFTs, ITL gaps, failures, achieved arrival rate).
    Arrival times are fixed in advance, so a busy event loop sends late rather than fewer."""
    rng = random.Random(3)
    ttfts: list[float] = []
    gaps: list[float] = []
    failures = 0
    prompt = " ".join(["word"] * INPUT_WORDS)

    async def one(client, i: int) -> None:
        nonlocal failures
        start = time.perf_counter()
        times = []
        try:
            stream = await client.chat.completions.create(
                model="tiny-llm", messages=[{"role": "user", "content": f"{prompt} {i}"}], temperature=0,
                max_tokens=OUTPUT_LEN, stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    times.append(time.perf_counter())
        except openai.APIError:
            failures += 1
            return
        if times:
            ttfts.append(times[0] - start)
            gaps.extend(b - a for a, b in zip(times, times[1:]))

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
        tasks = []
        start = time.perf_counter()
        due = 0.0
        while due < duration_s:
            await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
            tasks.append(asyncio.create_task(one(client, len(tasks))))
            due += rng.expovariate(rate)
        achieved = len(tasks) / (time.perf_counter() - start)
        await asyncio.gather(*tasks)
    return ttfts, gaps, failures, achieved


def test_planned_fleet_meets_its_slo_and_one_fewer_does_not(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")     # the workers' torch threads: one core each
    with Cluster(model=tiny_model, log_dir=str(tmp_path)) as cluster:
        prefill = [cluster.start_llm(prefill=("--capacity", "1"), decode=("--capacity", "8"))[0]]
        profile = asyncio.run(measure(cluster.url, "tiny-llm", INPUT_WORDS, OUTPUT_LEN, samples=8, burst=48))
        prefill.append(cluster.start_worker("prefill", "--capacity", "1"))
        cluster.wait_for_workers(3, timeout=120)
        workers, two = asyncio.run(measure_prefill_throughput(cluster.url, "tiny-llm", INPUT_WORDS, OUTPUT_LEN,
                                                                     burst=64))
        assert workers == 2
        curve = {**profile.prefill_rps_by_workers, 2: two}
        profile = dataclasses.replace(profile, prefill_rps_by_workers=curve)
        one, umax = curve[1], Slo.max_utilisation
        print(f"\nprefill throughput on this host: {curve}")
        assert umax * two > 1.1 * one, f"a second prefill worker adds too little on this host: {curve}"
        # More than one worker completes, less than two at max_utilisation: 35 % of the way from one to the
        # other leaves the planned fleet room for the host's noise, and one fewer a queue that grows
        # by ~10 % of a worker's throughput every second of the run.
        rate = one + 0.35 * (umax * two - one)
        slo = Slo(ttft_p90_s=12.0 * profile.prefill_s,
                  itl_p90_s=10.0 * (profile.itl_base_s + profile.itl_per_seq_s * 8))
        fleet = plan(profile, Workload(rate=rate, input_len=INPUT_WORDS, output_len=OUTPUT_LEN), slo)
        print(f"profile {profile}\nrate {rate:.2f}/s, SLO TTFT p90 {slo.ttft_p90_s * 1e3:.0f} ms, ITL p90 "
              f"{slo.itl_p90_s * 1e3:.0f} ms\n{fleet.table()}")
        assert fleet.bottleneck == "prefill" and fleet.counts["prefill"] == 2 and fleet.counts["decode"] == 1
        ttfts, gaps, failed, achieved = asyncio.run(_open_loop(cluster.url, rate, RUN_S))
        planned = (_p90(ttfts + [math.inf] * failed), _p90(gaps))   # a failed request misses the SLO
        print(f"planned fleet: {len(ttfts)} requests at {achieved:.2f}/s, TTFT p90 {planned[0] * 1e3:.0f} ms, "
              f"ITL p90 {planned[1] * 1e3:.0f} ms, failed {failed}, "
              f"{_attained(ttfts, failed, slo.ttft_p90_s):.0%} within the TTFT SLO")
        assert achieved >= 0.9 * rate   # the load generator kept up: the fleet saw the planned rate
        # One prefill worker fewer (drained), the same load.
        prefill.pop().stop()
        time.sleep(2.0)
        ttfts_less, gaps_less, failed_less, achieved_less = asyncio.run(_open_loop(cluster.url, rate, RUN_S))
        fewer = (_p90(ttfts_less + [math.inf] * failed_less), _p90(gaps_less))
        print(f"one prefill fewer: {len(ttfts_less)} requests at {achieved_less:.2f}/s, TTFT p90 "
              f"{fewer[0] * 1e3:.0f} ms, ITL p90 {fewer[1] * 1e3:.0f} ms, failed {failed_less}, "
              f"{_attained(ttfts_less, failed_less, slo.ttft_p90_s):.0%} within the TTFT SLO")
        assert achieved_less >= 0.9 * rate
        assert failed == 0 and planned[0] <= slo.ttft_p90_s and planned[1] <= slo.itl_p90_s
        assert fewer[0] > slo.ttft_p90_s
