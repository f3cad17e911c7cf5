"""The report of ``benchmarks/connectors.py`` (not a benchmark script of its own): per-row results
aggregated over the rounds, the Markdown tables, and their place in ``BENCHMARKS.md`` between the
generated-results markers of the ``## Connectors`` section.
"""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path

MIB = 1 << 20


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Linux {platform.release()}, "
            f"Python {platform.python_version()}")


def _rounds(result) -> list[float]:
    return result["rounds"] if isinstance(result, dict) else result


def aggregate(per_round: list[dict]) -> dict:
    """One row's results over the rounds: medians, and the per-round best GB/s under "rounds"."""
    if not isinstance(per_round[0], dict):   # a reference copy: per-round GB/s
        return {"gbps": statistics.median(per_round), "rounds": per_round}
    out = {k: statistics.median(r[k] for r in per_round) for k in ("gbps", "median_gbps", "put_ms", "get_ms")}
    out["rounds"] = [r["gbps"] for r in per_round]
    return out


def render(results: dict, sizes: list[int], command: str, refs: dict) -> str:
    def cell(name, size):
        r = results.get(name, {}).get(size)
        if r is None:
            return "skipped"
        return f"{r['gbps']:.2f}"

    lines = [f"Command: `{command}`", "", f"Machine: {machine()}.", "",
             ("put+get GB/s between two processes (best of the iterations, median over the rounds; in "
              "parentheses the share of the reference transport, median of the per-round ratios — for shared "
              "memory: of memcpy / of the cold-cache memcpy):"), "",
             "| | " + " | ".join(f"{s // MIB} MiB" for s in sizes) + " | reference |",
             "|---|" + "---|" * len(sizes) + "---|"]
    for name in ("memcpy", "memcpy, cold cache", "raw shared memory", "raw TCP", "raw Redis SET/GET",
                 "raw Mooncake TE", "raw Mooncake store", "raw Yuanrong KV"):
        lines.append(f"| {name} | " + " | ".join(cell(name, s) for s in sizes) + " | |")
    for name, ref_names in refs.items():
        cells = []
        for s in sizes:
            r = results.get(name, {}).get(s)
            if r is None:
                cells.append(results.get(name, {}).get("skipped", "skipped"))
                continue
            shares = []
            for ref in ref_names:
                base = results.get(ref, {}).get(s)
                if base is None:
                    continue
                ratios = [mine / theirs for mine, theirs in zip(r["rounds"], _rounds(base)) if theirs]
                if ratios:
                    shares.append(f"{100 * statistics.median(ratios):.0f} %")
            cells.append(f"{r['gbps']:.2f}" + (f" ({' / '.join(shares)})" if shares else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {' / '.join(ref_names)} |")
    lines += ["", ("The best iteration's put / get in ms, and the median iteration's put+get GB/s (each the "
                   "median over the rounds):"), "",
              "| | " + " | ".join(f"{s // MIB} MiB" for s in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for name in ["raw shared memory", "raw Redis SET/GET", "raw Mooncake TE", "raw Mooncake store", "raw Yuanrong KV",
                 *refs]:
        row = []
        for s in sizes:
            r = results.get(name, {}).get(s)
            row.append(f"{r['put_ms']:.2f} / {r['get_ms']:.2f}; median {r['median_gbps']:.2f} GB/s"
                       if isinstance(r, dict) else "–")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- benchmarks/connectors.py: begin -->\n", "<!-- benchmarks/connectors.py: end -->\n"


def update_section(path: Path, body: str) -> None:
    """Put ``body`` between the generated-results markers of the ``## Connectors`` section (creating
    the file, the section or the markers if missing); prose around the markers and every other
    section stay as they are."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = BEGIN + body + END
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        lines = text.splitlines(keepends=True)
        start = next((i for i, line in enumerate(lines) if line.strip() == "## Connectors"), None)
        if start is None:
            text = text.rstrip("\n") + "\n\n## Connectors\n\n" + block
        else:
            end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
            lines[end:end] = ["\n" if lines[end - 1].strip() else "", block, "\n" if end < len(lines) else ""]
            text = "".join(lines)
    path.write_text(text)
