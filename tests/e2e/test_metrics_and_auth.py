"""/metrics with vLLM's names and ours (the workers' heartbeat figures typed as counters and
gauges), and the API key on /v1 routes."""

from __future__ import annotations

import re

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from cluster import settled_workers
from conftest import ServeProcess
from omnirelay.broker.protocol import StatusReply
from omnirelay.gateway.metrics import GatewayMetrics


def _sample(text: str, name: str, labels: str = "") -> float:
    pattern = rf"^{re.escape(name)}(\{{[^}}]*{re.escape(labels)}[^}}]*\}})? (\S+)$"
    values = [float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE)]
    assert values, f"{name} {labels} not in /metrics"
    return sum(values)


def test_metrics_after_traffic(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for stream in (False, True):
        response = client.chat.completions.create(model="tiny-llm", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=8, temperature=0, stream=stream,
                                                  extra_body={"ignore_eos": True})
        if stream:
            list(response)
    settled_workers(server.url)   # worker counters ride on heartbeats: read once the cluster says they are final
    text = requests.get(server.url + "/metrics", timeout=10).text
    assert _sample(text, "vllm:generation_tokens_total") >= 16
    assert _sample(text, "vllm:prompt_tokens_total") > 0
    assert _sample(text, "vllm:time_to_first_token_seconds_count") >= 2
    assert _sample(text, "vllm:inter_token_latency_seconds_count") >= 14
    assert _sample(text, "vllm:e2e_request_latency_seconds_count") >= 2
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        _sample(text, name)
    assert _sample(text, "omnirelay_live_workers", 'role="prefill"') == 1
    assert _sample(text, "omnirelay_live_workers", 'role="decode"') == 1
    assert _sample(text, "omnirelay_stage_latency_seconds_count", 'stage="prefill"') >= 2
    assert _sample(text, "omnirelay_connector_transfer_seconds_sum", 'role="prefill"') > 0
    assert _sample(text, "omnirelay_connector_transfer_seconds_sum", 'role="decode"') > 0
    assert _sample(text, "omnirelay_broker_events", 'event="requests_admitted"') >= 2
    # The engines' own totals, per model and role: 2 prefills (first token each), 14 decoded tokens.
    assert _sample(text, "omnirelay_decode_tokens_total", 'model="tiny-llm",role="decode"') >= 14
    assert _sample(text, "omnirelay_prefill_tokens_total", 'role="prefill"') > 0
    assert _sample(text, "omnirelay_worker_steps_total", 'phase="decode",role="decode"') >= 7
    assert _sample(text, "omnirelay_worker_kv_blocks", 'role="decode"') > 0
    assert "# TYPE omnirelay_decode_tokens_total counter" in text
    assert "# TYPE omnirelay_worker_kv_blocks_free gauge" in text


def _families(metrics: GatewayMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def _values(family) -> dict:
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples if not s.name.endswith("_created")}


def test_worker_figures_are_typed_and_summed_per_model_and_role():
    def worker(worker_id: str, model: str, role: str, **stats) -> dict:
        return {"worker_id": worker_id, "model": model, "role": role, "running": 0, "waiting": 0, "stats": stats}

    metrics = GatewayMetrics()
    metrics.update_cluster(StatusReply(0, [
        worker("e1", "omni", "encode", encoded_requests=3, encoder_cache_hits=1, encode_steps=3, encoder_cache_items=2,
               step_age_s=0.5, connector_puts=3),
        worker("e2", "omni", "encode", encoded_requests=2, encoder_cache_hits=4, step_age_s=1.5, fresh_idea=7),
        worker("g1", "sd", "generate", images_generated=4, denoise_steps=10, failed_bad_request=1, running=1,
               denoiser_weight_bits=32, sick=True),
        worker("s1", "omni", "generate", speech_requests=2, talker_codes=40)], {}, {}))
    families = _families(metrics)
    encode = (("model", "omni"), ("role", "encode"))
    # prometheus_client's parser names a counter family without its _total suffix.
    assert families["omnirelay_encode_requests"].type == "counter"
    assert _values(families["omnirelay_encode_requests"]) == {encode: 5}          # summed over the pool
    assert _values(families["omnirelay_encoder_cache_hits"]) == {encode: 5}
    assert families["omnirelay_encoder_cache_items"].type == "gauge"
    assert _values(families["omnirelay_worker_step_age_seconds"]) == {encode: 1.5}  # the oldest, not a sum
    assert _values(families["omnirelay_images_generated"]) == {(("model", "sd"), ("role", "generate")): 4}
    assert _values(families["omnirelay_speech_requests"]) == {(("model", "omni"), ("role", "generate")): 2}
    assert _values(families["omnirelay_worker_steps"]) == {
        (("model", "omni"), ("phase", "encode"), ("role", "encode")): 3,
        (("model", "sd"), ("phase", "denoise"), ("role", "generate")): 10}
    assert _values(families["omnirelay_worker_failures"]) == {
        (("error_type", "bad_request"), ("model", "sd"), ("role", "generate")): 1}
    # A figure the table does not know is kept, untyped; flags and configuration are not figures.
    assert families["omnirelay_worker_stat"].type == "unknown"
    assert _values(families["omnirelay_worker_stat"]) == {
        (("model", "omni"), ("role", "encode"), ("stat", "fresh_idea")): 7}
    # The next scrape without the image worker: its figures are gone, not frozen.
    metrics.update_cluster(StatusReply(0, [worker("e1", "omni", "encode", encoded_requests=4)], {}, {}))
    families = _families(metrics)
    assert "omnirelay_images_generated" not in families
    assert _values(families["omnirelay_encode_requests"]) == {encode: 4}


@pytest.fixture(scope="module")
def keyed_server(tiny_model, tmp_path_factory):
    with ServeProcess(tiny_model, "--served-model-name", "tiny-llm", "--api-key", "s3cret",
                      log_path=str(tmp_path_factory.mktemp("keyed") / "serve.log")) as serve:
        yield serve


def test_api_key_guards_v1_routes(keyed_server):
    url = keyed_server.url
    assert requests.get(url + "/health", timeout=10).status_code == 200   # probes stay open by default
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        response = requests.get(url + "/v1/models", headers=headers, timeout=10)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0, timeout=60)
    assert client.chat.completions.create(model="tiny-llm", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, temperature=0).usage.completion_tokens >= 1
