"""Several models behind one broker and one gateway: each model's workers register under its name,
/v1/models lists them all, and each request is routed by its ``model`` field."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator

import openai
import pytest

from omnirelay.deploy.builders.llm import build_tiny_llm

from conftest import ServeProcess, hf_chat_greedy

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _two_models(first: str, second: str, names: tuple[str, str], tmp_path) -> Iterator[openai.OpenAI]:
    """``omni-serve`` of both model directories, served as ``names``; a client, once ``/v1/models``
    lists exactly those names. Stopped on exit."""
    with ServeProcess(first, second, "--served-model-name", names[0], "--served-model-name", names[1],
                      log_path=str(tmp_path / "serve.log")) as serve:
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert sorted(m.id for m in client.models.list().data) == sorted(names)
        yield client


def test_two_models_one_gateway(tiny_model, tmp_path):
    other = str(build_tiny_llm(tmp_path / "other-llm", seed=7))
    with _two_models(tiny_model, other, ("alpha", "beta"), tmp_path) as client:
        prompt = "Name a colour."
        answers = {}
        for name, path in (("alpha", tiny_model), ("beta", other)):
            response = client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=12, temperature=0,
                                                      extra_body={"return_token_ids": True})
            answers[name] = response.choices[0].model_extra["token_ids"]
            assert answers[name] == hf_chat_greedy(path, prompt, 12), name
        assert answers["alpha"] != answers["beta"]


def test_models_of_different_kinds_get_their_own_pipelines(tiny_model, tmp_path):
    """No --stage-configs-path: a causal LM gets prefill → decode, a diffusers directory one generate
    stage, both behind one gateway; each answers on its own endpoint and refuses the other's."""
    from omnirelay.deploy.builders.stable_diffusion import build_tiny_text_to_image
    images = str(build_tiny_text_to_image(tmp_path / "sd", seed=3))
    with _two_models(tiny_model, images, ("text", "pictures"), tmp_path) as client:
        chat = client.chat.completions.create(model="text", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
        assert chat.choices[0].model_extra["token_ids"] == hf_chat_greedy(tiny_model, "Hi", 6)
        picture = client.images.generate(model="pictures", prompt="a red square", size="64x64",
                                         extra_body={"num_inference_steps": 2, "seed": 1})
        assert base64.b64decode(picture.data[0].b64_json).startswith(b"\x89PNG")
        with pytest.raises(openai.UnprocessableEntityError):
            client.chat.completions.create(model="pictures", messages=[{"role": "user", "content": "Hi"}])


def test_model_kinds_and_bundled_pipelines(tiny_model, tmp_path):
    from omnirelay.deploy.builders.stable_diffusion import build_tiny_text_to_image
    from omnirelay.pipeline import PipelineError
    from omnirelay.deploy.served_models import plan_models
    from omnirelay.model_kind import model_kind
    images = str(build_tiny_text_to_image(tmp_path / "sd", seed=3))
    assert model_kind(tiny_model) == "llm" and model_kind(images) == "text-to-image"
    llm, sd = plan_models([(tiny_model, "a"), (images, "b")], None)
    assert llm.pipeline_file is None and llm.roles == ("prefill", "decode")
    assert sd.pipeline_file.endswith("text_to_image.yaml") and sd.roles == ("generate",)
    with pytest.raises(PipelineError, match="2 --stage-configs-path for 3 models"):
        plan_models([(tiny_model, "a"), (images, "b"), (tiny_model, "c")], [sd.pipeline_file, sd.pipeline_file])
