"""The first slice's prefill → decode handoff over every non-default backend, end to end.

``omni-serve`` runs with a stage-pipeline YAML whose ``kv`` connector names the backend: that one
line (plus its options) is the only difference from the default shared-memory run, which
``tests/e2e/test_e2e_openai.py`` covers. Greedy output must equal transformers on the same directory,
and the KV must have crossed the connector between the prefill and decode processes.
"""

from __future__ import annotations

import uuid

import openai
import pytest
import yaml

from cluster import settled_workers
from conftest import ServeProcess
from connector_servers import mooncake_skip_reason, started_mooncake_master, started_redis

PROMPTS = ["What is the capital of France?", "Tell me a short story about a cat and a dog."]
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture(params=["redis", "mooncake_transfer_engine", "mooncake_store"])
def kv_connector(request, tmp_path):
    """(type, options) for the pipeline's kv edge, with its server running."""
    name = request.param
    if name == "redis":
        server = started_redis(tmp_path)
        yield name, {"url": server.url, "prefix": f"ortest-{uuid.uuid4().hex[:8]}:"}
        server.stop()
        return
    if name == "mooncake_transfer_engine":
        reason = mooncake_skip_reason("mooncake.engine")
        if reason:
            pytest.skip(reason)
        yield name, {"directory": str(tmp_path / "te-directory"), "pool_mb": 64}
        return
    master = started_mooncake_master(tmp_path)
    yield name, {"master": master.address, "segment_mb": 64, "pool_mb": 64}
    master.stop()


def test_greedy_parity_over_backend(kv_connector, tiny_model, reference, tmp_path):
    kind, options = kv_connector
    pipeline = {
        "stages": [{"name": "prefill", "role": "prefill"}, {"name": "decode", "role": "decode"}],
        "connectors": {"kv": {"type": kind, "options": options}},
        "edges": [{"from": "prefill", "to": "decode", "connector": "kv"}],
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    serve = ServeProcess(tiny_model, "--served-model-name", "tiny-llm", "--stage-configs-path", str(path),
                         "--log-level", "WARNING", log_path=str(tmp_path / "serve.log"))
    try:
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for content in PROMPTS:
            response = client.chat.completions.create(
                model="tiny-llm", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=16,
                extra_body={"return_token_ids": True})
            assert response.choices[0].model_extra["token_ids"] == reference(content, 16), content
        # The stats arrive with the workers' heartbeats: read once the cluster says they are final.
        workers = {w["role"]: w for w in settled_workers(serve.url)}
        put = workers["prefill"]["stats"].get("connector_bytes_put", 0)
        got = workers["decode"]["stats"].get("connector_bytes_got", 0)
        assert put > 0 and got == put, (put, got)
        assert workers["prefill"]["pid"] != workers["decode"]["pid"]
    finally:
        assert serve.stop() == 0, serve.output()[-3000:]
