"""Several models behind one broker and one gateway: each model's workers register under its name,
/v1/models lists them all, and each request is routed by its ``model`` field."""

from __future__ import annotations

import openai
import pytest

from omnirelay.deploy.model_builder import build_tiny_llm

from conftest import ServeProcess, hf_chat_greedy

pytestmark = pytest.mark.slow


def test_two_models_one_gateway(tiny_model, tmp_path):
    other = str(build_tiny_llm(tmp_path / "other-llm", seed=7))
    serve = ServeProcess(tiny_model, other, "--served-model-name", "alpha", "--served-model-name", "beta",
                         log_path=str(tmp_path / "serve.log"))
    try:
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert sorted(m.id for m in client.models.list().data) == ["alpha", "beta"]
        prompt = "Name a colour."
        answers = {}
        for name, path in (("alpha", tiny_model), ("beta", other)):
            response = client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=12, temperature=0,
                                                      extra_body={"return_token_ids": True})
            answers[name] = response.choices[0].model_extra["token_ids"]
            assert answers[name] == hf_chat_greedy(path, prompt, 12), name
        assert answers["alpha"] != answers["beta"]
    finally:
        serve.stop()
