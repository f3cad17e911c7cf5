"""A connector slowed past a request's deadline: the client gets a 504 in time, the worker keeps
serving, and the late transfer's data is deleted instead of waiting for its TTL."""

from __future__ import annotations

import time

import pytest
import requests

from kv_fault_support import kv_fault_cluster, kv_fault_pipeline, segments_of

pytestmark = pytest.mark.slow
PUT_DELAY_S = 1.5


@pytest.fixture
def slow_link(tiny_model, tmp_path):
    pipeline = kv_fault_pipeline(tmp_path / "slow.yaml", {"put_delay_s": PUT_DELAY_S})
    with kv_fault_cluster(tiny_model, str(tmp_path), pipeline, short_timeout_s=1.0, long_timeout_s=30) as cluster:
        yield cluster


def _chat(url: str) -> requests.Response:
    body = {"model": "tiny-llm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    return requests.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_slow_connector_past_the_deadline(slow_link):
    started = time.monotonic()
    response = _chat(slow_link.short_url)
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"
    assert elapsed < 1.0 + 1.0, f"the 504 took {elapsed:.2f}s"
    # The late put is deleted once its StageDone reaches the broker, not left for the TTL.
    deadline = time.monotonic() + 10
    while segments_of(slow_link.prefill.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert segments_of(slow_link.prefill.pid) == []
    # With a deadline the link can meet, the same cluster answers.
    ok = _chat(slow_link.url)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
