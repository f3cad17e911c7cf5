"""The parts of the error contract the other suites do not reach: 503 with Retry-After when a role
the model needs has no live worker, and ``--protect-probes`` closing /health, /metrics and /cluster
behind the API key. (The 502 of a failed transfer, with its Retry-After, is in
``test_transfer_retry.py``: it needs workers.)

One broker and one gateway, no worker at all: nothing here loads a model's weights.
"""

from __future__ import annotations

import requests
import pytest

from cluster import Cluster

KEY = "k3y-for-the-contract"
AUTH = {"Authorization": f"Bearer {KEY}"}

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def no_workers(tiny_model, tmp_path_factory):
    with Cluster(model=tiny_model, log_dir=str(tmp_path_factory.mktemp("contract"))) as cluster:
        cluster.start_broker()
        # No worker is coming: the 503 after a 2 s wait for one, not the default's restart-sized wait.
        cluster.start_gateway("--api-key", KEY, "--protect-probes", "--worker-wait", "2")
        yield cluster


def _assert_error(response: requests.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code, body
    assert "request_id" in body and "stage" in body
    if status in (429, 502, 503):   # the recoverable ones say when to try again
        assert int(response.headers["Retry-After"]) >= 1
    else:
        assert "Retry-After" not in response.headers
    return body


@pytest.mark.parametrize("path", ["/health", "/metrics", "/cluster", "/status.json"])
def test_protected_probes_need_the_key(no_workers, path):
    _assert_error(requests.get(no_workers.url + path, timeout=10), 401, "unauthorized")
    _assert_error(requests.get(no_workers.url + path, headers={"Authorization": "Bearer nope"}, timeout=10),
                  401, "unauthorized")
    assert requests.get(no_workers.url + path, headers=AUTH, timeout=10).status_code in (200, 503)


def test_wrong_keys_of_every_length_get_401(no_workers):
    for supplied in ("", "Bearer", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}X", KEY):
        response = requests.get(no_workers.url + "/v1/models", headers={"Authorization": supplied}, timeout=10)
        _assert_error(response, 401, "unauthorized")
    assert requests.get(no_workers.url + "/v1/models", headers=AUTH, timeout=10).status_code == 200


def test_503_with_retry_after_when_no_worker_serves_a_role(no_workers):
    body = _assert_error(requests.get(no_workers.url + "/health", headers=AUTH, timeout=10), 503, "unavailable")
    assert "no live worker" in body["error"]["message"]
    response = requests.post(no_workers.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                             json={"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 2})
    body = _assert_error(response, 503, "unavailable")
    assert body["request_id"] and body["error"]["type"] == "server_error"
