"""A connector slowed past a request's deadline: the client gets a 504 in time, the worker keeps
serving, and the late transfer's data is deleted instead of waiting for its TTL."""

from __future__ import annotations

import json
import os
import time

import pytest
import requests

from cluster import Cluster

pytestmark = pytest.mark.slow
PUT_DELAY_S = 1.5


@pytest.fixture
def slow_link(tiny_model, tmp_path):
    pipeline = tmp_path / "slow.yaml"
    pipeline.write_text(json.dumps({   # YAML is a superset of JSON
        "stages": [{"name": "prefill", "role": "prefill"}, {"name": "decode", "role": "decode"}],
        "connectors": {"kv": {"type": "fault_injection",
                              "options": {"inner": "shared_memory", "put_delay_s": PUT_DELAY_S}}},
        "edges": [{"from": "prefill", "to": "decode", "connector": "kv"}]}))
    cluster = Cluster(model=tiny_model, log_dir=str(tmp_path))
    try:
        cluster.start_broker()
        cluster.prefill = cluster.start_worker("prefill", "--stage-configs-path", str(pipeline))
        cluster.start_worker("decode", "--stage-configs-path", str(pipeline))
        cluster.start_gateway("--request-timeout", "1.0")
        cluster.short_url = cluster.url
        cluster.start_gateway("--request-timeout", "30")
        cluster.wait_healthy()
        yield cluster
    finally:
        cluster.stop()


def _chat(url: str) -> requests.Response:
    body = {"model": "tiny-llm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    return requests.post(url + "/v1/chat/completions", json=body, timeout=60)


def _segments_of(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"omnirelay-{pid}-")
            and "-c" not in name[len(f"omnirelay-{pid}"):]]   # buffer-pool files are reused, not per key


def test_slow_connector_past_the_deadline(slow_link):
    started = time.monotonic()
    response = _chat(slow_link.short_url)
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"
    assert elapsed < 1.0 + 1.0, f"the 504 took {elapsed:.2f}s"
    # The late put is deleted once its StageDone reaches the broker, not left for the TTL.
    deadline = time.monotonic() + 10
    while _segments_of(slow_link.prefill.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _segments_of(slow_link.prefill.pid) == []
    # With a deadline the link can meet, the same cluster answers.
    ok = _chat(slow_link.url)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
