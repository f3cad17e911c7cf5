"""/metrics with vLLM's names and ours, and the API key on /v1 routes."""

from __future__ import annotations

import re
import time

import openai
import pytest
import requests

from conftest import ServeProcess


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
    # Worker counters ride on heartbeats: poll (bounded) until one sent after the traffic arrived.
    deadline = time.monotonic() + 15
    while True:
        text = requests.get(server.url + "/metrics", timeout=10).text
        transfers = [_sample(text, "omnirelay_connector_transfer_seconds_sum", f'role="{role}"')
                     for role in ("prefill", "decode")]
        if min(transfers) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
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


@pytest.fixture(scope="module")
def keyed_server(tiny_model, tmp_path_factory):
    serve = ServeProcess(tiny_model, "--served-model-name", "tiny-llm", "--api-key", "s3cret",
                         log_path=str(tmp_path_factory.mktemp("keyed") / "serve.log"))
    yield serve
    serve.stop()


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
