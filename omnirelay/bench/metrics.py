"""From per-request results to the figures of one pass, named as ``vllm bench serve`` names them.

Definitions (over completed requests; failed ones only count as failures):

* ``ttft``, ``e2el``: one value per request; ``tpot`` = ``(e2el - ttft) / (output_tokens - 1)`` for
  requests with more than one output token; ``itl``: every gap between chunks, all requests pooled.
* For each: ``mean_``, ``median_``, ``std_`` and ``pNN_`` (linear interpolation between closest
  ranks, as ``numpy.percentile``) in milliseconds; ``None`` when there is no value.
* ``request_throughput`` = completed / duration; ``output_throughput`` = output tokens / duration;
  ``total_token_throughput`` adds the input tokens; duration is the wall time of the pass.
* Goodput: a request is good when every SLO given holds (``ttft``, ``tpot``, ``e2el`` in ms, each
  ``<=``); ``request_goodput`` = good requests / duration.
"""

from __future__ import annotations

import collections
import math

from .client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (``numpy.percentile``'s default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slo: dict[str, float] = {}
    for spec in specs:
        name, colon, value = spec.partition(":")
        if not colon or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {spec!r}: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        if name in slo:
            raise ValueError(f"goodput SLO {name!r} given twice")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {spec!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"goodput SLO {spec!r}: must be a positive number of milliseconds")
        slo[name] = ms
    return slo


def tpot(result: RequestResult) -> float | None:
    """Seconds per output token after the first; ``None`` with fewer than two output tokens."""
    if result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def is_good(result: RequestResult, slo: dict[str, float]) -> bool:
    if not result.success:
        return False
    values = {"ttft": result.ttft, "tpot": tpot(result) or 0.0, "e2el": result.latency}
    return all(values[name] * 1000 <= limit for name, limit in slo.items())


def error_summary(results: list[RequestResult]) -> list[dict]:
    """Failed requests grouped by error text, most frequent first."""
    counts = collections.Counter(r.error or "unknown error" for r in results if not r.success)
    return [{"error": error, "count": count} for error, count in counts.most_common()]


def _stats(name: str, values: list[float], percentiles: tuple[int, ...]) -> dict:
    ms = [v * 1000 for v in values]
    out: dict = {}
    if ms:
        mean = sum(ms) / len(ms)
        out[f"mean_{name}_ms"] = mean
        out[f"median_{name}_ms"] = percentile(ms, 50)
        out[f"std_{name}_ms"] = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))
    else:
        out[f"mean_{name}_ms"] = out[f"median_{name}_ms"] = out[f"std_{name}_ms"] = None
    for q in percentiles:
        out[f"p{q:g}_{name}_ms"] = percentile(ms, q) if ms else None
    return out


def summarize(results: list[RequestResult], duration: float, slo: dict[str, float] | None = None,
              percentiles: tuple[int, ...] = DEFAULT_PERCENTILES) -> dict:
    """The figures of one pass; per-request lists (seconds) cover completed requests only."""
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len or 0 for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [t for t in (tpot(r) for r in done) if t is not None]
    per_metric = {"ttft": [r.ttft for r in done], "tpot": tpots,
                  "itl": [gap for r in done for gap in r.itl], "e2el": [r.latency for r in done]}
    summary: dict = {
        "duration": duration,
        "num_prompts": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "output_tokens_from_usage": sum(1 for r in done if r.usage_reported),
        "request_throughput": len(done) / duration if duration > 0 else None,
        "output_throughput": output_tokens / duration if duration > 0 else None,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else None,
    }
    if slo:
        good = sum(1 for r in done if is_good(r, slo))
        summary["goodput_slo_ms"] = dict(slo)
        summary["good_requests"] = good
        summary["request_goodput"] = good / duration if duration > 0 else None
    for name in METRICS:
        summary.update(_stats(name, per_metric[name], percentiles))
    # Spoken answers: vLLM-Omni's audio_ttfp (ms, like the latencies) and audio_rtf (a ratio).
    summary.update(_stats("audio_ttfp", [r.audio_ttfp for r in done if r.audio_ttfp is not None], percentiles))
    rtfs = [r.audio_rtf for r in done if r.audio_rtf is not None]
    summary.update({k.replace("_ms", ""): (v / 1000 if v is not None else None)
                    for k, v in _stats("audio_rtf", rtfs, percentiles).items()})
    summary["audio_ttfps"] = [r.audio_ttfp for r in done if r.audio_ttfp is not None]
    summary["audio_rtfs"] = rtfs
    summary["errors"] = error_summary(results)
    summary["input_lens"] = [r.prompt_len for r in done]
    summary["output_lens"] = [r.output_tokens for r in done]
    summary["ttfts"] = per_metric["ttft"]
    summary["tpots"] = tpots
    summary["e2els"] = per_metric["e2el"]
    summary["itls"] = [r.itl for r in done]
    return summary
