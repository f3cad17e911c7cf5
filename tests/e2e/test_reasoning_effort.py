"""``reasoning_effort`` served as vLLM renders it: the chat template gets ``reasoning_effort`` and,
unless ``chat_template_kwargs`` set it, ``enable_thinking`` (false for ``"none"``), each only where the
template reads it — so on Qwen3 (tiny-qwen3 carries its real template, ``--reasoning-parser qwen3``)
``"none"`` turns the thinking off. Through the official ``openai`` client: chat, /tokenize and
Responses' ``reasoning.effort``; completions refuse it (422)."""

from __future__ import annotations

import openai
import pytest
import requests

from omnirelay.deploy.builders.qwen3 import cached_qwen3
from omnirelay.errors import BadRequest
from omnirelay.gateway.config import ServedModel
from omnirelay.gateway.models import ModelRuntime
from omnirelay.gateway.schema import TemplateOptions, implied_variables

from conftest import ServeProcess

MODEL = "tiny-qwen3"
ASK = [{"role": "user", "content": "Is the sky blue?"}]
# A template that grades its thinking by the effort (as some model families' do).
GRADED = ("{% for m in messages %}{{ m.content }}\n{% endfor %}"
          "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}{% endif %}")


def test_implied_variables_only_where_the_template_reads_them():
    assert implied_variables({}) == {}
    assert implied_variables({"reasoning_effort": "none"}) == {"reasoning_effort": "none", "enable_thinking": False}
    for bad in ("huge", 3, ""):
        with pytest.raises(BadRequest) as caught:
            implied_variables({"reasoning_effort": bad})
        assert caught.value.param == "reasoning_effort"
    model = ModelRuntime(ServedModel(name=MODEL, path=str(cached_qwen3())))
    graded = TemplateOptions(chat_template=GRADED, implied=implied_variables({"reasoning_effort": "low"}))
    assert model.render_chat(ASK, None, graded).endswith("effort=low")   # enable_thinking: not read, not given
    assert model.chat_variables(graded) == {"reasoning_effort": "low"}
    qwen3 = TemplateOptions(implied=implied_variables({"reasoning_effort": "none"}))
    assert model.chat_variables(qwen3) == {"enable_thinking": False}   # Qwen3's reads no reasoning_effort
    overridden = TemplateOptions(kwargs={"enable_thinking": True}, implied=qwen3.implied)
    assert model.chat_variables(overridden) == {"enable_thinking": True}   # the request's own kwargs win


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("reasoning-effort") / "serve.log")
    with ServeProcess(str(cached_qwen3()), "--served-model-name", MODEL, "--reasoning-parser", "qwen3",
                      log_path=log) as process:
        yield process


@pytest.fixture(scope="module")
def client(serve):
    return openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0,
                                          extra_body={"return_token_ids": True, **kwargs.pop("extra_body", {})},
                                          **kwargs)


def test_none_turns_qwen3_thinking_off(client, serve):
    thinking = _chat(client)
    off = _chat(client, reasoning_effort="none")
    switched = _chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.model_extra["prompt_token_ids"] == switched.model_extra["prompt_token_ids"] \
        != thinking.model_extra["prompt_token_ids"]
    # The answer changes with it: the random model never closes a <think> block, so with thinking on
    # all it says is reasoning; off, it is the answer.
    assert thinking.choices[0].message.content is None and thinking.choices[0].message.model_extra["reasoning"]
    assert off.choices[0].message.content and off.choices[0].message.model_extra["reasoning"] is None
    high = _chat(client, reasoning_effort="high")
    assert high.model_extra["prompt_token_ids"] == thinking.model_extra["prompt_token_ids"]
    kept_on = _chat(client, reasoning_effort="none", extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert kept_on.model_extra["prompt_token_ids"] == thinking.model_extra["prompt_token_ids"]
    tokenized = requests.post(serve.url + "/tokenize", timeout=60,
                              json={"model": MODEL, "messages": ASK, "reasoning_effort": "none"}).json()
    assert tokenized["tokens"] == off.model_extra["prompt_token_ids"]


def test_refused_where_it_cannot_apply(client):
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, extra_body={"reasoning_effort": "huge"})
    assert caught.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"reasoning_effort": "low"})
    assert caught.value.body["param"] == "reasoning_effort"


def test_responses_reasoning_effort(client):
    thinking = client.responses.create(model=MODEL, input="Is the sky blue?", max_output_tokens=6, temperature=0)
    off = client.responses.create(model=MODEL, input="Is the sky blue?", max_output_tokens=6, temperature=0,
                                  reasoning={"effort": "none"})
    assert [item.type for item in thinking.output] == ["reasoning"]
    assert [item.type for item in off.output] == ["message"] and off.reasoning.effort == "none"
    assert off.usage.input_tokens != thinking.usage.input_tokens
