"""What the autoscaler observes: per-role load from the broker's view (``GET /cluster``) and latency
percentiles from the gateway's histograms (``GET /metrics``).

Contract: :func:`role_loads` is pure (the JSON of ``/cluster`` in, one :class:`RoleLoad` per role of
one model out). :class:`LatencyWindow` keeps the previous scrape of a histogram and answers the
percentile of the observations made *since* then (cumulative buckets differenced), so a latency
spike ten minutes ago does not keep a role scaled up; it returns None when no request finished in
the window. :class:`GatewayProbe` does the HTTP; it is the only part here that does I/O.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

TTFT_METRIC = "vllm:time_to_first_token_seconds"
ITL_METRIC = "vllm:inter_token_latency_seconds"


@dataclasses.dataclass(frozen=True)
class RoleLoad:
    """One role's load as the broker sees it. ``assigned``: tasks the broker has handed to the
    role's workers and not seen finish; ``capacity``: what they said they can hold at once."""

    role: str
    workers: int
    capacity: int
    assigned: int
    queued: int

    @property
    def utilisation(self) -> float:
        return self.assigned / self.capacity if self.capacity else (1.0 if self.queued else 0.0)


def role_loads(cluster: dict, model: str) -> dict[str, RoleLoad]:
    """Per role of ``model``: live workers, their capacity and assigned tasks, and the broker queue."""
    sums: dict[str, list[int]] = {}
    for worker in cluster.get("workers", []):
        if worker.get("model") != model:
            continue
        row = sums.setdefault(worker["role"], [0, 0, 0])
        row[0] += 1
        row[1] += int(worker.get("capacity", 0))
        row[2] += int(worker.get("assigned", 0))
    for key, depth in cluster.get("queued", {}).items():
        name, _, role = key.rpartition("/")
        if name == model:
            sums.setdefault(role, [0, 0, 0])
    queued = {key.rpartition("/")[2]: int(v) for key, v in cluster.get("queued", {}).items()
              if key.rpartition("/")[0] == model}
    return {role: RoleLoad(role, n, cap, assigned, queued.get(role, 0)) for role, (n, cap, assigned) in sums.items()}


def histogram(text: str, name: str, model: str | None = None) -> list[tuple[float, float]]:
    """Cumulative ``(upper bound, count)`` buckets of histogram ``name`` in a Prometheus exposition,
    summed over label sets (or only ``model_name=model``)."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                continue
            if model is not None and sample.labels.get("model_name") != model:
                continue
            bound = float(sample.labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return sorted(buckets.items())


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of cumulative buckets, interpolated within its bucket as Prometheus'
    ``histogram_quantile`` does; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            width = count - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / width if width else 0.0)
        lower_bound, lower_count = bound, count
    return lower_bound


class LatencyWindow:
    """Percentiles of one histogram over the observations since the previous :meth:`update`."""

    def __init__(self, name: str, model: str | None = None):
        self.name, self.model = name, model
        self._last: dict[float, float] = {}

    def update(self, text: str, q: float) -> float | None:
        now = histogram(text, self.name, self.model)
        delta = [(bound, count - self._last.get(bound, 0.0)) for bound, count in now]
        self._last = dict(now)
        return quantile(delta, q)


class GatewayProbe:
    """Reads ``/cluster`` and ``/metrics`` of one gateway (``api_key`` for a gateway with protected probes)."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 5.0):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _get(self, path: str) -> bytes:
        request = urllib.request.Request(self.url + path, headers=self.headers)
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return response.read()

    def cluster(self) -> dict:
        return json.loads(self._get("/cluster"))

    def metrics(self) -> str:
        return self._get("/metrics").decode()
