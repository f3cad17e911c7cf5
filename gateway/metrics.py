"""Prometheus metrics of the gateway and, at scrape time, of the cluster behind it.

Names follow vLLM where vLLM has the metric, so existing dashboards work: ``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds``, ``vllm:e2e_request_latency_seconds``, ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:kv_cache_usage_perc``. Ours carry the ``omnirelay_`` prefix: per-role queue depth, live
workers, per-stage latency (from the broker), connector bytes and transfers (from the workers'
heartbeats), rejections, retries, migrations (resumed streams) and cancellations.

Request figures are observed by :class:`RequestTimer`, a hook the HTTP layer calls at arrival, at
each chunk and at the end; nothing here runs inside a worker's decode loop. Cluster figures are
refreshed from one broker status query per scrape.

Worker engine figures (:class:`WorkerStatsCollector`): each worker's heartbeat carries a flat map of
its engine's figures; the broker keeps the last one. They are exported per ``model`` and ``role``,
summed over the workers of that pool: the engines' running totals as counters (``omnirelay_encode_
requests_total``, ``omnirelay_encoder_cache_hits_total``, ``omnirelay_images_generated_total``, …,
``omnirelay_worker_steps_total{phase}``, ``omnirelay_worker_failures_total{error_type}``), their
instantaneous figures as gauges (running, waiting, KV blocks, cache sizes; the step age is the
oldest, not a sum). A worker that leaves takes its totals with it, which Prometheus' ``rate()``
reads as a counter reset. A figure this table does not know is still exported, as
``omnirelay_worker_stat{stat}`` of unknown type. They are as fresh as the last heartbeat.
"""

from __future__ import annotations

import collections
import time

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, UnknownMetricFamily

from omnirelay.broker.protocol import StatusReply
from omnirelay.errors import Cancelled

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0)


# Engine running totals from worker heartbeats: stat key → (metric name, help). Names follow
# Prometheus' conventions (the family gets ``_total`` when rendered).
_WORKER_COUNTERS = {
    "encoded_requests": ("omnirelay_encode_requests", "Requests whose media the encode workers encoded"),
    "encoder_cache_hits": ("omnirelay_encoder_cache_hits", "Media items the encode workers took from their cache"),
    "encoded_images": ("omnirelay_encoded_images", "Images the encode workers ran through the vision encoder"),
    "encoded_audio": ("omnirelay_encoded_audio_clips", "Audio clips the encode workers ran through the audio encoder"),
    "prefill_tokens": ("omnirelay_prefill_tokens", "Prompt tokens the prefill workers computed"),
    "prefix_cached_tokens": ("omnirelay_prefix_cached_tokens", "Prompt tokens the prefill workers took from "
                                                              "their prefix cache"),
    "prefix_hit_requests": ("omnirelay_prefix_hit_requests", "Prefills that found part of their prompt cached"),
    "media_prompts": ("omnirelay_media_prompts", "Prefills of prompts with encoded media"),
    "kv_handoffs": ("omnirelay_kv_handoffs", "KV caches the prefill workers handed to decode"),
    "speech_handoffs": ("omnirelay_speech_handoffs", "Hidden states handed to the speech generate stage"),
    "decode_tokens": ("omnirelay_decode_tokens", "Tokens the decode workers generated"),
    "kv_loads": ("omnirelay_kv_loads", "KV caches the decode workers fetched from a connector"),
    "kv_swapped_in": ("omnirelay_kv_swapped_in", "Preempted sequences whose KV came back"),
    "recomputed_tokens": ("omnirelay_recomputed_tokens", "Tokens recomputed after a preemption"),
    "preemptions": ("omnirelay_preemptions", "Sequences preempted for lack of KV blocks"),
    "cancelled": ("omnirelay_worker_cancellations", "Requests the workers dropped on a cancel"),
    "cancelled_running": ("omnirelay_worker_cancellations_running", "Running generations stopped by a cancel"),
    "batches": ("omnirelay_generate_batches", "Batches the image generate workers ran"),
    "images_generated": ("omnirelay_images_generated", "Images the generate workers produced"),
    "videos_generated": ("omnirelay_videos_generated", "Videos the generate workers produced"),
    "frames_generated": ("omnirelay_video_frames_generated", "Video frames the generate workers produced"),
    "cache_computed_steps": ("omnirelay_diffusion_cache_computed_steps",
                             "Denoising branch-steps a step-cached generate worker ran through its transformer"),
    "cache_skipped_steps": ("omnirelay_diffusion_cache_skipped_steps",
                            "Denoising branch-steps a step cache skipped (reusing a cached residual)"),
    "speech_requests": ("omnirelay_speech_requests", "Utterances the speech generate workers produced"),
    "talker_codes": ("omnirelay_talker_codes", "Codec tokens the talker produced"),
    "audio_samples": ("omnirelay_audio_samples", "Audio samples the speech generate workers produced"),
    "keepalives": ("omnirelay_worker_keepalives", "Engine steps that outlasted a heartbeat interval"),
    # Speculative decoding (decode workers with --speculative-config), under vLLM's names.
    "spec_decode_num_drafts": ("vllm:spec_decode_num_drafts", "Drafts proposed (one per sequence and step)"),
    "spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Tokens drafted"),
    "spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted"),
}
# Per draft position: key prefix + position → vLLM's family, labelled by position.
_SPEC_PER_POS = "spec_decode_num_accepted_tokens_per_pos_"
# Instantaneous figures: stat key → (metric name, help, how a pool combines them).
_WORKER_GAUGES = {
    "running": ("omnirelay_worker_requests_running", "Requests in the workers' running batches", sum),
    "waiting": ("omnirelay_worker_requests_waiting", "Requests queued inside the workers", sum),
    "free_kv_blocks": ("omnirelay_worker_kv_blocks_free", "Free KV cache blocks", sum),
    "kv_blocks_total": ("omnirelay_worker_kv_blocks", "KV cache blocks", sum),
    "prefix_cached_blocks": ("omnirelay_prefix_cached_blocks", "KV blocks held by the prefix cache", sum),
    "encoder_cache_items": ("omnirelay_encoder_cache_items", "Media items in the encoder cache", sum),
    "step_age_s": ("omnirelay_worker_step_age_seconds", "Age of the oldest engine step in progress", max),
    "private_memory_bytes": ("omnirelay_worker_private_memory_bytes", "Memory the workers hold unshared "
                             "(Private_Dirty: heap, packed weights, KV pools; not the mapped checkpoint)", sum),
}
# Described elsewhere (connector_* feed the omnirelay_connector_* families) or not a figure of load.
_WORKER_SKIPPED = ("connector_", "denoiser_weight_bits", "sequence_parallel_size")


class WorkerStatsCollector:
    """The workers' heartbeat figures as Prometheus families, rebuilt from the last status reply."""

    def __init__(self) -> None:
        self._pools: dict[tuple[str, str], list[dict]] = {}

    def update(self, workers: list[dict]) -> None:
        pools: dict[tuple[str, str], list[dict]] = {}
        for worker in workers:
            stats = {k: v for k, v in worker.get("stats", {}).items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
            # The heartbeat's own load fields win over copies in the stats map (-1: no KV cache).
            stats.update({k: worker[k] for k in ("running", "waiting") if k in worker})
            if worker.get("free_kv_blocks", -1) >= 0:
                stats["free_kv_blocks"] = worker["free_kv_blocks"]
            pools.setdefault((worker["model"], worker["role"]), []).append(stats)
        self._pools = pools

    def describe(self) -> list:
        return []   # names depend on what the workers report: no collision check at registration

    def collect(self):
        labels = ["model", "role"]
        counters = {key: CounterMetricFamily(name, text, labels=labels) for key, (name, text) in _WORKER_COUNTERS.items()}
        gauges = {key: GaugeMetricFamily(name, text, labels=labels) for key, (name, text, _) in _WORKER_GAUGES.items()}
        steps = CounterMetricFamily("omnirelay_worker_steps", "Engine steps, by phase", labels=labels + ["phase"])
        failures = CounterMetricFamily("omnirelay_worker_failures", "Requests a worker engine failed, by error type",
                                       labels=labels + ["error_type"])
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Drafted tokens accepted, by position in the draft",
                                      labels=labels + ["position"])
        other = UnknownMetricFamily("omnirelay_worker_stat", "Other worker figures, as reported",
                                    labels=labels + ["stat"])
        for (model, role), pool in sorted(self._pools.items()):
            keys = sorted({key for stats in pool for key in stats})
            for key in keys:
                values = [stats[key] for stats in pool if key in stats]
                if key in _WORKER_COUNTERS:
                    counters[key].add_metric([model, role], sum(values))
                elif key in _WORKER_GAUGES:
                    gauges[key].add_metric([model, role], _WORKER_GAUGES[key][2](values))
                elif key.endswith("_steps"):
                    steps.add_metric([model, role, key[:-len("_steps")]], sum(values))
                elif key.startswith(_SPEC_PER_POS):
                    per_pos.add_metric([model, role, key[len(_SPEC_PER_POS):]], sum(values))
                elif key.startswith("failed_"):
                    failures.add_metric([model, role, key[len("failed_"):]], sum(values))
                elif not key.startswith(_WORKER_SKIPPED):
                    other.add_metric([model, role, key], sum(values))
        for family in (*counters.values(), *gauges.values(), steps, failures, per_pos, other):
            if family.samples:
                yield family


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens", m,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", m, registry=r)
        self.requests = Counter("omnirelay_requests", "Requests finished, by outcome", ["model_name", "outcome"],
                                registry=r)
        self.errors = Counter("omnirelay_request_errors", "Failed requests by error type and stage",
                              ["error_type", "stage"], registry=r)
        self.migrations = Counter("omnirelay_stream_migrations", "Streams resumed on another worker", registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in a decode batch", registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued in the broker or a worker", registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of decode KV blocks in use (0-1)", registry=r)
        self.queue_depth = Gauge("omnirelay_queue_depth", "Broker queue depth", ["model", "role"], registry=r)
        self.live_workers = Gauge("omnirelay_live_workers", "Registered workers", ["model", "role"], registry=r)
        self.connector_bytes = Gauge("omnirelay_connector_bytes", "Bytes moved through connectors (cumulative)",
                                     ["role", "direction"], registry=r)
        self.connector_transfers = Gauge("omnirelay_connector_transfers", "Connector puts/gets (cumulative)",
                                         ["role", "direction"], registry=r)
        self.transfer_seconds = Gauge("omnirelay_connector_transfer_seconds_sum",
                                      "Time spent in connector puts (out) and gets (in), cumulative",
                                      ["role", "direction"], registry=r)
        self.stage_seconds = Gauge("omnirelay_stage_latency_seconds_sum", "Total time stages ran, per stage",
                                   ["stage"], registry=r)
        self.stage_count = Gauge("omnirelay_stage_latency_seconds_count", "Stages completed, per stage",
                                 ["stage"], registry=r)
        # Plain running totals for the status page's rates (the Prometheus objects keep theirs private).
        self.totals: collections.Counter[str] = collections.Counter()
        self.broker_events = Gauge("omnirelay_broker_events", "Broker counters (rejections, retries, "
                                   "cancellations, expirations, malformed messages)", ["event"], registry=r)
        self.worker_stats = WorkerStatsCollector()
        r.register(self.worker_stats)

    def timer(self, model: str) -> "RequestTimer":
        return RequestTimer(self, model)

    def update_cluster(self, status: StatusReply) -> None:
        """Refresh the cluster gauges from one broker status reply."""
        running = waiting = used = total = 0
        for gauge in (self.live_workers, self.queue_depth, self.connector_bytes, self.connector_transfers,
                      self.transfer_seconds,
                      self.stage_seconds, self.stage_count, self.broker_events):
            gauge.clear()
        sums: dict[tuple, float] = {}
        self.worker_stats.update(status.workers)
        for worker in status.workers:
            self.live_workers.labels(worker["model"], worker["role"]).inc()
            stats = worker.get("stats", {})
            waiting += worker.get("waiting", 0)
            if worker["role"] == "decode":
                running += worker.get("running", 0)
                blocks = stats.get("kv_blocks_total", 0)
                total += blocks
                used += blocks - max(0, worker.get("free_kv_blocks", 0))
            for direction, key in (("out", "connector_put_us_total"), ("in", "connector_get_us_total")):
                sums[("seconds", worker["role"], direction)] = sums.get(("seconds", worker["role"], direction), 0) \
                    + stats.get(key, 0) / 1e6
            for direction, bytes_key, count_key in (("out", "connector_bytes_put", "connector_puts"),
                                                    ("in", "connector_bytes_got", "connector_gets")):
                sums[("bytes", worker["role"], direction)] = sums.get(("bytes", worker["role"], direction), 0) \
                    + stats.get(bytes_key, 0)
                sums[("count", worker["role"], direction)] = sums.get(("count", worker["role"], direction), 0) \
                    + stats.get(count_key, 0)
        gauges = {"bytes": self.connector_bytes, "count": self.connector_transfers, "seconds": self.transfer_seconds}
        for (kind, role, direction), value in sums.items():
            gauges[kind].labels(role, direction).set(value)
        for key, depth in status.queued.items():
            model, _, role = key.rpartition("/")
            self.queue_depth.labels(model, role).set(depth)
            waiting += depth
        for name, value in status.counters.items():
            if name.startswith("stage_seconds:"):
                self.stage_seconds.labels(name.split(":", 1)[1]).set(value / 1e6)
            elif name.startswith("stage_done:"):
                self.stage_count.labels(name.split(":", 1)[1]).set(value)
            else:
                self.broker_events.labels(name).set(value)
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(used / total if total else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request: call :meth:`tokens` per arriving chunk and :meth:`finish` once."""

    def __init__(self, metrics: GatewayMetrics, model: str):
        self._metrics = metrics
        self._model = model
        self._start = time.monotonic()
        self._last: float | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.monotonic()
        labels = self._metrics.ttft.labels(self._model)
        if self._last is None:
            labels.observe(now - self._start)
            self._metrics.totals["ttft_sum"] += now - self._start
            self._metrics.totals["ttft_count"] += 1
            count -= 1
        elif count > 0:
            gap = (now - self._last) / count
            itl = self._metrics.itl.labels(self._model)
            for _ in range(count):
                itl.observe(gap)
        self._last = now

    def finish(self, prompt_tokens: int, completion_tokens: int, outcome: str, resumes: int = 0) -> None:
        m = self._metrics
        m.e2e.labels(self._model).observe(time.monotonic() - self._start)
        m.prompt_tokens.labels(self._model).inc(prompt_tokens)
        m.generation_tokens.labels(self._model).inc(completion_tokens)
        m.requests.labels(self._model, outcome).inc()
        m.totals["requests"] += 1
        m.totals["generation_tokens"] += completion_tokens
        if outcome not in ("ok", Cancelled.error_type):
            m.totals["errors"] += 1
        if resumes:
            m.migrations.inc(resumes)
