"""The gateway's OpenAPI document matches what it accepts: schemathesis, against a live server,
finds no 5xx and no response outside the documented schema (bounded number of examples).

Two servers: ``omni-serve`` of the tiny LLM (chat and completions answered for real), and a gateway
serving a tiny Qwen2.5-Omni (speech), a text-to-image and a text-to-video pipeline with a broker but
no worker — nothing loads weights, and a request the validators let through ends 503 (no live
worker) within a short request timeout. There every request the document calls valid must pass
validation (schemathesis' positive-data check: never 4xx, except 404 for a job id that does not exist).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import requests

from cluster import Cluster
from conftest import ServeProcess
from repo_paths import REPO_ROOT

pytestmark = pytest.mark.slow
PIPELINES = REPO_ROOT / "deploy" / "pipelines"


@pytest.fixture(scope="module")
def small_context_server(tiny_model, tmp_path_factory):
    # A short context keeps every generated request fast.
    with ServeProcess(tiny_model, "--served-model-name", "tiny-llm", "--max-model-len", "128",
                      log_path=str(tmp_path_factory.mktemp("openapi") / "serve.log")) as serve:
        yield serve


def test_openapi_document_lists_the_routes(small_context_server):
    doc = requests.get(small_context_server.url + "/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/responses/{response_id}",
            "/v1/models", "/health"} <= set(doc["paths"])
    props = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert props["properties"]["model"]["enum"] == ["tiny-llm"]
    # Nothing here speaks, draws or films: those routes and chat's audio output are not offered.
    assert props["properties"]["modalities"]["enum"] == [["text"]] and "audio" not in props["properties"]
    assert not {"/v1/audio/speech", "/v1/images/generations", "/v1/videos", "/v1/audio/transcriptions"} \
        & set(doc["paths"])   # nor hears
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert {"408", "502"} <= set(doc["paths"][path]["post"]["responses"])


def test_schemathesis_finds_no_server_error_or_schema_violation(small_context_server):
    result = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", small_context_server.url + "/openapi.json",
         "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
                     "response_schema_conformance",
         "--max-examples", "25", "--request-timeout", "30", "--generation-deterministic", "--no-color"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "No issues found" in result.stdout


@pytest.fixture(scope="module")
def media_gateway(tmp_path_factory):
    from omnirelay.deploy.builders.stable_diffusion import build_tiny_text_to_image
    from omnirelay.deploy.builders.omni import build_tiny_omni
    from omnirelay.deploy.builders.video import build_tiny_text_to_video

    models = tmp_path_factory.mktemp("models")
    omni = build_tiny_omni(models / "tiny-omni", seed=0)
    image = build_tiny_text_to_image(models / "tiny-image", seed=0)
    video = build_tiny_text_to_video(models / "tiny-video", seed=0)
    with Cluster(model=str(omni), model_name="tiny-omni",
                 log_dir=str(tmp_path_factory.mktemp("media-openapi"))) as cluster:
        cluster.start_broker()
        # 0.3 s: a request (or video job) that passed validation waits no longer for a worker that never comes.
        cluster.start_gateway("--stage-configs-path", str(PIPELINES / "omni.yaml"),
                              "--model", str(image), "--served-model-name", "tiny-image",
                              "--stage-configs-path", str(PIPELINES / "text_to_image.yaml"),
                              "--model", str(video), "--served-model-name", "tiny-video",
                              "--stage-configs-path", str(PIPELINES / "text_to_video.yaml"),
                              "--request-timeout", "0.3", "--video-timeout", "0.3")
        yield cluster


# Checks are chosen here, not on the command line: a check named there ignores the per-route switch.
_MEDIA_CONFIG = """
[checks]
enabled = false

[checks.not_a_server_error]
enabled = true
expected-statuses = ["2xx", "4xx", "503", "504"]   # no worker: a validated request ends here

[checks.status_code_conformance]
enabled = true

[checks.content_type_conformance]
enabled = true

[checks.response_schema_conformance]
enabled = true

[checks.positive_data_acceptance]
enabled = true
expected-statuses = ["2xx", "404", "503", "504"]   # 404: a video id that does not exist

[[operations]]
include-path-regex = "^/v1/(audio/voices|images/edits|audio/transcriptions|audio/translations)"
# The served families clone no voice: a valid upload is a 422 by design, a preset voice is not deleted;
# an edit's image and a transcription's audio must be real files, which a schema cannot say (random
# bytes are a 400).
checks.positive_data_acceptance.enabled = false

[[operations]]
include-path-regex = "^/v1/((chat/)?completions|responses)$"
# A prompt longer than the context is a 400 the document cannot rule out (it depends on tokenization).
checks.positive_data_acceptance.enabled = false
"""


def test_media_routes_document_what_their_validators_accept(media_gateway, tmp_path):
    doc = requests.get(media_gateway.url + "/openapi.json", timeout=10).json()
    assert {"/v1/audio/speech", "/v1/images/generations", "/v1/videos", "/v1/videos/{video_id}",
            "/v1/audio/transcriptions", "/v1/audio/translations"} <= set(doc["paths"])
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["properties"]["model"]["enum"] == ["tiny-omni"]   # the pipelines do not chat
    assert chat["properties"]["audio"]["properties"]["voice"]["enum"] == ["Chelsie", "Ethan"]
    speech = doc["paths"]["/v1/audio/speech"]["post"]
    assert speech["requestBody"]["content"]["application/json"]["schema"]["properties"]["model"]["enum"] == ["tiny-omni"]
    assert {"408", "502", "503", "504"} <= set(speech["responses"])
    config = tmp_path / "schemathesis.toml"
    config.write_text(_MEDIA_CONFIG)
    # Valid data only: what is checked here is that the document promises no more than the
    # validators accept; malformed input is the first test's business.
    result = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
         media_gateway.url + "/openapi.json", "--exclude-path", "/health", "--mode", "positive",
         "--max-examples", "10", "--request-timeout", "30", "--generation-deterministic", "--no-color"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    counts = re.search(r"(\d+) generated, (\d+) passed", result.stdout)   # a warning replaces "No issues found"
    assert counts and int(counts.group(1)) == int(counts.group(2)) > 0, result.stdout[-3000:]
