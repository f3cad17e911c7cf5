"""The gateway's OpenAPI document matches what it accepts: schemathesis, against a live server,
finds no 5xx and no response outside the documented schema (bounded number of examples)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import requests

from conftest import ServeProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_context_server(tiny_model, tmp_path_factory):
    # A short context keeps every generated request fast.
    serve = ServeProcess(tiny_model, "--served-model-name", "tiny-llm", "--max-model-len", "128",
                         log_path=str(tmp_path_factory.mktemp("openapi") / "serve.log"))
    yield serve
    serve.stop()


def test_openapi_document_lists_the_routes(small_context_server):
    doc = requests.get(small_context_server.url + "/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(doc["paths"])
    props = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert props["properties"]["model"]["enum"] == ["tiny-llm"]


def test_schemathesis_finds_no_server_error_or_schema_violation(small_context_server):
    result = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", small_context_server.url + "/openapi.json",
         "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
                     "response_schema_conformance",
         "--max-examples", "25", "--request-timeout", "30", "--generation-deterministic", "--no-color"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "No issues found" in result.stdout
