"""What a chat request hands its template that the server does not check, as vLLM 0.32 passes it:
``chat_template_kwargs`` the template does not read (clients send ``enable_thinking`` to every
model) and message roles other than OpenAI's. Neither is refused; the gateway's log names each
once per model, so the server keeps the record of what it let through (gateway/models.py)."""

from __future__ import annotations

import logging

import pytest

from omnirelay.errors import BadRequest
from omnirelay.gateway.config import ServedModel
from omnirelay.gateway.models import ModelRuntime
from omnirelay.gateway.schema import parse_chat, template_options

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(tiny_model):
    return ModelRuntime(ServedModel(name="tiny", path=tiny_model))


def notes(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "omnirelay.gateway" and repr(name) in r.getMessage()]


def test_a_kwarg_the_template_does_not_read_renders_as_without_it_and_is_logged_once(model, caplog):
    plain = model.render_chat(USER)
    caplog.set_level(logging.WARNING, logger="omnirelay.gateway")
    body = {"chat_template_kwargs": {"enable_thinking": False, "unused_knob_a": 1}}
    for _ in range(3):
        assert model.render_chat(USER, template=template_options(body)) == plain
    assert len(notes(caplog, "enable_thinking")) == 1 and len(notes(caplog, "unused_knob_a")) == 1
    assert "chat_template_kwargs" in notes(caplog, "enable_thinking")[0]


def test_a_kwarg_the_template_reads_still_changes_the_prompt_and_is_not_logged(model, caplog):
    caplog.set_level(logging.WARNING, logger="omnirelay.gateway")
    own = {"chat_template": "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
           "chat_template_kwargs": {"greeting": "HELLO "}}
    assert model.render_chat(USER, template=template_options(own)) == "HELLO hi"
    assert not notes(caplog, "greeting")


def test_an_argument_of_the_rendering_itself_is_still_refused(model):
    with pytest.raises(BadRequest) as caught:
        model.render_chat(USER, template=template_options({"chat_template_kwargs": {"tokenize": True}}))
    assert caught.value.param == "chat_template_kwargs.tokenize"


def test_a_custom_role_reaches_the_template_and_is_logged_once(model, caplog):
    caplog.set_level(logging.WARNING, logger="omnirelay.gateway")
    messages = parse_chat({"model": "tiny", "messages": [{"role": "critic", "content": "be brief"}, *USER]}).messages
    for _ in range(2):
        assert "<|im_start|>critic\nbe brief" in model.render_chat(messages)
    assert len(notes(caplog, "critic")) == 1 and "role" in notes(caplog, "critic")[0]
    model.render_chat(USER + [{"role": "assistant", "content": "ok"}])
    assert not notes(caplog, "assistant")   # OpenAI's roles are not news


@pytest.mark.parametrize("role", ["", None, 3, ["user"]])
def test_a_role_that_is_not_a_non_empty_string_is_a_400(role):
    with pytest.raises(BadRequest) as caught:
        parse_chat({"model": "tiny", "messages": [{"role": role, "content": "hi"}]})
    assert caught.value.param == "messages[0].role"
