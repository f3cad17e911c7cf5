"""vLLM's small service routes (issue #26): ``/version``, ``/ping`` (GET and POST, the health probe
under SageMaker's name) and ``GET /v1/models/{id}``, through the official ``openai`` client where
it has a call for them."""

from __future__ import annotations

from importlib.metadata import version

import openai
import pytest
import requests


def test_version_and_ping(server):
    reply = requests.get(server.url + "/version", timeout=30)
    assert reply.status_code == 200 and reply.json() == {"version": version("omnirelay")}
    for method in ("GET", "POST"):
        ping = requests.request(method, server.url + "/ping", timeout=30)
        health = requests.get(server.url + "/health", timeout=30)
        assert ping.status_code == health.status_code == 200 and ping.json() == health.json()


def test_one_model_card(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    listed = client.models.list().data[0]
    card = client.models.retrieve(listed.id)
    assert card.model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("org/no-such-model")
    assert "'org/no-such-model'" in caught.value.body["message"] and caught.value.body["param"] == "model"
