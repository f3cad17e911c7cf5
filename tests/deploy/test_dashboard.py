"""The Grafana dashboard (deploy/grafana-dashboard.json) queries only what ``/metrics`` serves: a real
broker, prefill and decode workers and gateway answer a streamed chat and a request that fails, and
then every metric each panel's PromQL names exists in the gateway's ``/metrics`` with every label
the query groups or filters by and its legend prints."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from cluster import Cluster, settled_workers
from repo_paths import REPO_ROOT

DASHBOARD = os.path.join(REPO_ROOT, "deploy", "grafana-dashboard.json")
# PromQL words that are not metric names.
PROMQL_WORDS = {"sum", "avg", "max", "min", "count", "rate", "irate", "increase", "histogram_quantile", "by",
                "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "topk",
                "bottomk", "label_values", "offset", "bool"}


def queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, expr, legend) of every query target."""
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((panel["title"], target["expr"], target.get("legendFormat", "")))
    return found


def names_in(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and the label names a PromQL expression uses."""
    labels = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {name.strip() for name in group.split(",") if name.strip()}
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\b(?:by|without)\s*\([^)]*\)|\"[^\"]*\"", " ", expr)
    metrics = {word for word in re.findall(r"[a-zA-Z_:][\w:]*", bare) if word not in PROMQL_WORDS}
    return metrics, labels


def test_the_extractor_reads_names_and_labels():
    metrics, labels = names_in('histogram_quantile(0.9, sum by (le, model_name) '
                               '(rate(vllm:time_to_first_token_seconds_bucket{model_name=~"$model"}[5m])))')
    assert metrics == {"vllm:time_to_first_token_seconds_bucket"} and labels == {"le", "model_name"}
    metrics, labels = names_in("sum by (stage) (rate(a_sum[1m])) / sum by (stage) (rate(a_count[1m]))")
    assert metrics == {"a_sum", "a_count"} and labels == {"stage"}


@pytest.fixture(scope="module")
def metrics_texts(tiny_model, tmp_path_factory) -> list[str]:
    """/metrics after one streamed chat (every role live), then after a request that failed for want
    of a decode worker: a dashboard spans both moments."""
    with Cluster(model=tiny_model, log_dir=str(tmp_path_factory.mktemp("dashboard"))) as cluster:
        _, decode = cluster.start_llm()
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(model="tiny-llm", messages=[{"role": "user", "content": "Hello"}],
                                                max_tokens=8, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        settled_workers(cluster.url)   # the workers' figures travel in heartbeats: read them once counted
        texts = [requests.get(cluster.url + "/metrics", timeout=10).text]
        assert decode.stop(signal.SIGTERM) == 0   # drains and unregisters
        deadline = time.monotonic() + 30
        while any(worker["role"] == "decode" for worker in cluster.workers()):
            assert time.monotonic() < deadline, "the broker still lists the stopped decode worker"
            time.sleep(0.2)
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(model="tiny-llm", messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=8)
        assert failed.value.status_code == 503
        return texts + [requests.get(cluster.url + "/metrics", timeout=10).text]


def test_every_query_names_served_metrics_and_labels(metrics_texts):
    with open(DASHBOARD) as handle:
        dashboard = json.load(handle)
    served: dict[str, set[str]] = {}
    for text in metrics_texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                served.setdefault(sample.name, set()).update(sample.labels)
    checked = queries(dashboard)
    assert len(checked) >= 15
    for title, expr, legend in checked:
        metrics, labels = names_in(expr)
        labels |= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        assert metrics, (title, expr)
        for metric in metrics:
            assert metric in served, f"panel {title!r}: {metric} is not in /metrics"
            assert labels <= served[metric], f"panel {title!r}: {metric} lacks labels {labels - served[metric]}"
    # The model variable reads a metric and label that exist too.
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
    assert variable["definition"] == "label_values(omnirelay_live_workers, model)"
    assert "model" in served["omnirelay_live_workers"]


def test_the_dashboard_covers_what_it_promises():
    with open(DASHBOARD) as handle:
        dashboard = json.load(handle)
    exprs = " ".join(expr for _, expr, _ in queries(dashboard))
    for metric in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                   "vllm:e2e_request_latency_seconds_bucket", "omnirelay_queue_depth", "omnirelay_live_workers",
                   "omnirelay_stage_latency_seconds_count", "omnirelay_connector_bytes",
                   "omnirelay_connector_transfer_seconds_sum", "omnirelay_request_errors_total"):
        assert metric in exprs, metric
    for quantile in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({quantile}," in exprs
