"""``omni-plan``: the E:P:D:G worker counts that meet a workload's SLOs at least cost.

Inputs: a :class:`Profile` of the roles on this host (``omni-plan profile`` measures one against a
running gateway: :mod:`.profile`), a :class:`Workload` (request rate, input/output lengths, share of
requests with media to encode and with media to generate) and :class:`Slo` (TTFT p90, ITL p90).

The model, per role (each worker of a role is independent; the broker hands a role's queue to the
least-loaded worker with credit, so a role is one multi-server queue):

* **encode, prefill, generate**: an M/M/c queue, c = workers, service rate ``rps`` per worker (the
  profile's measured throughput of one worker at its batch size). The p90 of the wait comes from
  Erlang C: P(wait > t) = C(c, λ/μ)·exp(−(cμ − λ)t). A role must also stay below ``max_utilisation``
  (an M/M/c near 1 has an unbounded tail, whatever its p90 says at steady state).
* **workers sharing a host's cores** (prefill): a worker with a GPU (or cores) of its own is an
  independent server, and p workers complete p·``prefill_rps``. Workers on one host with fewer cores
  than they can use compete for them, and a second worker adds what the cores left idle, not a
  worker's worth. ``prefill_rps_by_workers`` holds the measured aggregate throughput of n prefill
  workers on the host (``omni-plan profile`` against fleets of 1, 2, … prefill workers, ``--merge``
  to collect the points). With two or more points the planner takes the fleet's throughput from
  them: linear between measured counts, and flat beyond the largest (the cores are spent: more
  workers only split them; it does not assume throughput it has not seen). Each of p workers then
  serves at μ_p = throughput(p)/p and a prefill takes ``prefill_s``·``prefill_rps``/μ_p (slowed by
  the sharing) — so past the host's saturation adding workers only lengthens TTFT. (Decode is
  sized from its own profile alone: measure it with the decode fleet you plan on a shared host.)
* **TTFT p90** ≈ prefill wait p90 + prefill latency, plus the encode wait p90 + encode latency when at
  least ``media_share`` > 0 (the first token comes from prefill, after the encode of the prompt's media).
* **decode**: a worker's ITL grows with its batch: itl(B) = ``itl_base_s`` + ``itl_per_seq_s``·B (the
  profile fits the p90 at two batch sizes). By Little's law the fleet holds λ·out·itl(B) streams, so
  with d workers each holds B = λ·out·a / (d − λ·out·b); d is feasible when that B fits the
  worker's ``decode_capacity`` and itl(B) meets the ITL SLO.

Cost: ``cost`` per worker of each role (default 1; e.g. GPUs per worker). Decode and generate are
sized alone (the least count that is feasible); encode and prefill together (the cheapest pair
meeting the TTFT SLO). :func:`plan` returns the counts with the predicted figures, and
:func:`frontier` the least cost as the SLO tightens (the plot).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

ROLES = ("encode", "prefill", "decode", "generate")


@dataclasses.dataclass(frozen=True)
class Profile:
    """Per-worker figures of this host (measured; see :mod:`.profile`). ``*_rps``: requests one worker
    completes per second when busy; ``*_s``: a request's latency through the role when idle."""

    prefill_rps: float
    prefill_s: float
    itl_base_s: float
    itl_per_seq_s: float
    decode_capacity: int
    encode_rps: float = 0.0
    encode_s: float = 0.0
    generate_rps: float = 0.0
    generate_s: float = 0.0
    cost: dict[str, float] = dataclasses.field(default_factory=lambda: {r: 1.0 for r in ROLES})
    # n → requests per second n prefill workers complete together on the host (see the module docstring)
    prefill_rps_by_workers: dict[int, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> "Profile":
        fields = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        if "prefill_rps_by_workers" in fields:   # JSON object keys are strings
            fields["prefill_rps_by_workers"] = {int(n): float(v) for n, v in fields["prefill_rps_by_workers"].items()}
        return cls(**fields)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "cost"}


def prefill_throughput(p: int, profile: Profile) -> float:
    """Requests per second ``p`` prefill workers complete together: p·``prefill_rps`` for independent
    workers; from ``prefill_rps_by_workers`` when it has two or more points (shared cores)."""
    table = profile.prefill_rps_by_workers
    if p <= 0:
        return 0.0
    if len(table) < 2:
        return p * profile.prefill_rps
    if p in table:
        return table[p]
    counts = sorted(table)
    if p > counts[-1]:
        return table[counts[-1]]
    lower = max((n for n in counts if n < p), default=0)
    upper = min(n for n in counts if n > p)
    low_rps = table.get(lower, 0.0)
    return low_rps + (table[upper] - low_rps) * (p - lower) / (upper - lower)


def _prefill_rps_per_worker(p: int, profile: Profile) -> float:
    return prefill_throughput(p, profile) / p if p > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Workload:
    rate: float                 # requests per second
    input_len: int = 128
    output_len: int = 64
    media_share: float = 0.0    # share of requests with media to encode
    generate_share: float = 0.0  # share of requests that end in a generate stage (images, speech)


@dataclasses.dataclass(frozen=True)
class Slo:
    ttft_p90_s: float
    itl_p90_s: float
    max_utilisation: float = 0.85


@dataclasses.dataclass(frozen=True)
class Plan:
    counts: dict[str, int]
    cost: float
    ttft_p90_s: float
    itl_p90_s: float
    utilisation: dict[str, float]
    decode_batch: float
    bottleneck: str             # the role whose count one lower breaks the SLO first (most cost-critical)

    def table(self) -> str:
        rows = [f"{'role':<10}{'workers':>8}{'utilisation':>13}"]
        for role in ROLES:
            if self.counts.get(role):
                rows.append(f"{role:<10}{self.counts[role]:>8}{self.utilisation.get(role, 0.0):>13.2f}")
        rows.append(f"cost {self.cost:g}; predicted TTFT p90 {self.ttft_p90_s * 1e3:.1f} ms, ITL p90 "
                    f"{self.itl_p90_s * 1e3:.1f} ms at decode batch {self.decode_batch:.1f}; bottleneck {self.bottleneck}")
        return "\n".join(rows)


class Infeasible(ValueError):
    """No fleet within the search bounds meets the SLO (the message says which role fails)."""


def erlang_c(c: int, offered: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with offered load λ/μ (< c)."""
    if offered <= 0:
        return 0.0
    if offered >= c:
        return 1.0
    term, total = 1.0, 1.0
    for k in range(1, c):
        term *= offered / k
        total += term
    last = term * offered / c
    last_scaled = last * c / (c - offered)
    return last_scaled / (total + last_scaled)


def wait_p90(c: int, rate: float, rps: float) -> float:
    """p90 of the wait in an M/M/c queue (inf when unstable)."""
    if rate <= 0:
        return 0.0
    if c <= 0 or rate >= c * rps:
        return math.inf
    waits = erlang_c(c, rate / rps)
    return 0.0 if waits <= 0.1 else math.log(waits / 0.1) / (c * rps - rate)


def decode_batch(d: int, workload: Workload, profile: Profile) -> float:
    """Streams per decode worker at steady state (inf when d workers cannot keep up)."""
    flow = workload.rate * workload.output_len      # tokens per second the fleet must produce
    denominator = d - flow * profile.itl_per_seq_s
    if d <= 0 or denominator <= 0:
        return math.inf
    return flow * profile.itl_base_s / denominator


def _itl(batch: float, profile: Profile) -> float:
    return profile.itl_base_s + profile.itl_per_seq_s * batch


def _ttft(e: int, p: int, workload: Workload, profile: Profile) -> float:
    per_worker = _prefill_rps_per_worker(p, profile)
    if per_worker <= 0:
        return math.inf
    ttft = wait_p90(p, workload.rate, per_worker) + profile.prefill_s * profile.prefill_rps / per_worker
    if workload.media_share > 0:
        ttft += wait_p90(e, workload.rate * workload.media_share, profile.encode_rps) + profile.encode_s
    return ttft


def _least(feasible, limit: int, what: str) -> int:
    for n in range(1, limit + 1):
        if feasible(n):
            return n
    raise Infeasible(f"no {what} count up to {limit} meets the SLO")


def plan(profile: Profile, workload: Workload, slo: Slo, limit: int = 512) -> Plan:
    rate, umax = workload.rate, slo.max_utilisation
    counts = {"encode": 0, "prefill": 0, "decode": 0, "generate": 0}

    def decode_ok(d: int) -> bool:
        batch = decode_batch(d, workload, profile)
        return batch <= profile.decode_capacity and _itl(batch, profile) <= slo.itl_p90_s

    counts["decode"] = _least(decode_ok, limit, "decode")
    if workload.generate_share > 0:
        gen_rate = rate * workload.generate_share
        counts["generate"] = _least(lambda g: gen_rate <= umax * g * profile.generate_rps, limit, "generate")
    # Encode and prefill together: the cheapest stable pair whose TTFT p90 meets the SLO.
    enc_rate = rate * workload.media_share
    e_min = _least(lambda e: enc_rate <= umax * e * profile.encode_rps, limit, "encode") if enc_rate else 0
    try:
        p_min = _least(lambda p: rate <= umax * prefill_throughput(p, profile), limit, "prefill")
    except Infeasible:
        if len(profile.prefill_rps_by_workers) < 2:
            raise
        most = max(profile.prefill_rps_by_workers.values())
        raise Infeasible(f"{rate:g} requests/s is more than this host's prefill workers complete: at most "
                         f"{most:.2f}/s measured (at utilisation {umax:g}: {umax * most:.2f}/s); more hosts") from None
    best: tuple[float, int, int] | None = None
    for e in range(e_min, (e_min + 16 if enc_rate else 0) + 1):
        for p in range(p_min, p_min + 64):
            if _ttft(e, p, workload, profile) <= slo.ttft_p90_s:
                cost = e * profile.cost.get("encode", 1.0) + p * profile.cost.get("prefill", 1.0)
                if best is None or cost < best[0]:
                    best = (cost, e, p)
                break
    if best is None:
        raise Infeasible(f"TTFT p90 {slo.ttft_p90_s * 1e3:.0f} ms cannot be met: prefill alone takes "
                         f"{profile.prefill_s * 1e3:.0f} ms" + (f" and encode {profile.encode_s * 1e3:.0f} ms"
                                                                if enc_rate else ""))
    counts["encode"], counts["prefill"] = best[1], best[2]
    batch = decode_batch(counts["decode"], workload, profile)
    utilisation = {"prefill": rate / prefill_throughput(counts["prefill"], profile),
                   "decode": batch / profile.decode_capacity}
    if counts["encode"]:
        utilisation["encode"] = enc_rate / (counts["encode"] * profile.encode_rps)
    if counts["generate"]:
        utilisation["generate"] = rate * workload.generate_share / (counts["generate"] * profile.generate_rps)
    ttft = _ttft(counts["encode"], counts["prefill"], workload, profile)
    cost = sum(counts[r] * profile.cost.get(r, 1.0) for r in ROLES)
    # The bottleneck: of the SLO-bound roles, the one whose count one lower misses by the most.
    misses = {"prefill": _ttft(counts["encode"], counts["prefill"] - 1, workload, profile) / slo.ttft_p90_s,
              "decode": (_itl(decode_batch(counts["decode"] - 1, workload, profile), profile) / slo.itl_p90_s
                         if decode_batch(counts["decode"] - 1, workload, profile) <= profile.decode_capacity
                         else math.inf)}
    if counts["encode"]:
        misses["encode"] = _ttft(counts["encode"] - 1, counts["prefill"], workload, profile) / slo.ttft_p90_s
    bottleneck = max(misses, key=lambda r: misses[r])
    return Plan(counts, cost, ttft, _itl(batch, profile), {k: round(v, 3) for k, v in utilisation.items()},
                batch, bottleneck)


def frontier(profile: Profile, workload: Workload, slo: Slo, steps: int = 12) -> list[dict]:
    """Least cost as each SLO tightens (the other held): rows of {slo, value_s, cost, counts}."""
    rows = []
    for name, base in (("ttft", slo.ttft_p90_s), ("itl", slo.itl_p90_s)):
        for i in range(steps):
            value = base * (0.25 + 1.75 * i / (steps - 1))
            tight = dataclasses.replace(slo, **({"ttft_p90_s": value} if name == "ttft" else {"itl_p90_s": value}))
            try:
                result = plan(profile, workload, tight)
                rows.append({"slo": name, "value_s": value, "cost": result.cost, "counts": result.counts})
            except Infeasible:
                rows.append({"slo": name, "value_s": value, "cost": None, "counts": None})
    return rows


def plot_frontier(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for axis, name, label in ((axes[0], "ttft", "TTFT p90 SLO (ms)"), (axes[1], "itl", "ITL p90 SLO (ms)")):
        points = [(r["value_s"] * 1e3, r["cost"]) for r in rows if r["slo"] == name and r["cost"] is not None]
        if points:
            axis.step(*zip(*points), where="post", marker="o")
        axis.set_xlabel(label)
        axis.set_ylabel("least fleet cost")
        axis.grid(alpha=0.3)
    figure.suptitle("SLO frontier: the cheapest fleet that meets each SLO")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["profile"]:
        from .profile import main as profile_main
        return profile_main(argv[1:])
    parser = argparse.ArgumentParser(prog="omni-plan", description="worker counts per role that meet SLOs at "
                                     "least cost (omni-plan profile … measures the profile first)")
    parser.add_argument("--profile", required=True, help="JSON written by `omni-plan profile`")
    parser.add_argument("--rate", type=float, required=True, help="requests per second")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--media-share", type=float, default=0.0, help="share of requests with media to encode")
    parser.add_argument("--generate-share", type=float, default=0.0, help="share ending in a generate stage")
    parser.add_argument("--ttft-p90", type=float, required=True, help="seconds")
    parser.add_argument("--itl-p90", type=float, required=True, help="seconds")
    parser.add_argument("--max-utilisation", type=float, default=Slo.max_utilisation)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    parser.add_argument("--plot", default=None, help="write the SLO frontier as a PNG here")
    args = parser.parse_args(argv)
    with open(args.profile) as handle:
        profile = Profile.from_json(json.load(handle))
    workload = Workload(args.rate, args.input_len, args.output_len, args.media_share, args.generate_share)
    slo = Slo(args.ttft_p90, args.itl_p90, args.max_utilisation)
    try:
        result = plan(profile, workload, slo)
    except Infeasible as exc:
        print(f"omni-plan: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({**dataclasses.asdict(result), "frontier": frontier(profile, workload, slo)}, indent=1))
    else:
        print(result.table())
    if args.plot:
        plot_frontier(frontier(profile, workload, slo), args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
