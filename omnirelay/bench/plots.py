"""PNG plots of benchmark runs (matplotlib, Agg backend; ``pip install 'omnirelay[bench]'``).

* ``latency_cdf.png``: the CDFs of TTFT, TPOT, ITL and E2E latency, one curve per run.
* ``throughput_vs_concurrency.png`` (a sweep only): output tokens/s and requests/s against the
  concurrency limit, next to median and p99 TTFT and TPOT.
"""

from __future__ import annotations

import os

_CDF_PANELS = (("ttfts", "TTFT"), ("tpots", "TPOT"), ("itls", "ITL"), ("e2els", "E2E latency"))


class PlotError(RuntimeError):
    """Plots were asked for but matplotlib is not installed."""


def check_available() -> None:
    try:
        import matplotlib  # noqa: F401  (imported lazily: the CLI starts faster without it)
    except ImportError as exc:
        raise PlotError("plots need matplotlib: pip install 'omnirelay[bench]'") from exc


def _pyplot():
    check_available()
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _label(run: dict) -> str:
    concurrency = run.get("max_concurrency")
    return f"concurrency {concurrency}" if concurrency else f"rate {run.get('request_rate')}"


def _values_ms(run: dict, key: str) -> list[float]:
    values = run.get(key) or []
    if key == "itls":
        values = [gap for gaps in values for gap in gaps]
    return sorted(v * 1000 for v in values)


def plot_latency_cdfs(runs: list[dict], path: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, title) in zip(axes.flat, _CDF_PANELS):
        for run in runs:
            values = _values_ms(run, key)
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, fractions, where="post", label=_label(run))
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of " + ("chunks" if key == "itls" else "requests"))
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_throughput_vs_concurrency(runs: list[dict], path: str) -> None:
    plt = _pyplot()
    points = sorted((r for r in runs if r.get("max_concurrency")), key=lambda r: r["max_concurrency"])
    xs = [r["max_concurrency"] for r in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(xs, [r["output_throughput"] or 0 for r in points], "o-", label="output tokens/s")
    left.set_xlabel("max concurrency")
    left.set_ylabel("output tokens/s")
    left.set_xscale("log", base=2)
    left.grid(alpha=0.3)
    requests = left.twinx()
    requests.plot(xs, [r["request_throughput"] or 0 for r in points], "s--", color="tab:orange",
                  label="requests/s")
    requests.set_ylabel("requests/s")
    left.set_title("throughput")
    left.legend(loc="upper left")
    requests.legend(loc="lower right")
    for key, style in (("median_ttft_ms", "o-"), ("p99_ttft_ms", "o:"), ("median_tpot_ms", "s-"),
                       ("p99_tpot_ms", "s:")):
        right.plot(xs, [r.get(key) or 0 for r in points], style, label=key.removesuffix("_ms"))
    right.set_xlabel("max concurrency")
    right.set_ylabel("ms")
    right.set_xscale("log", base=2)
    right.set_title("latency")
    right.grid(alpha=0.3)
    right.legend(fontsize="small")
    for ax in (left, right):
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(runs: list[dict], plot_dir: str) -> list[str]:
    """Write the plots that the runs allow; returns their paths."""
    os.makedirs(plot_dir, exist_ok=True)
    paths = [os.path.join(plot_dir, "latency_cdf.png")]
    plot_latency_cdfs(runs, paths[0])
    if len([r for r in runs if r.get("max_concurrency")]) > 1:
        paths.append(os.path.join(plot_dir, "throughput_vs_concurrency.png"))
        plot_throughput_vs_concurrency(runs, paths[1])
    return paths
