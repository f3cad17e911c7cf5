"""``max_tokens`` against the context, as vLLM 0.32 serves it: beyond the room the prompt leaves it
is clamped to that room (the answer then ends with ``length``), absent it is the whole room, and
only a prompt that leaves no room at all is a 400 (in vLLM's words, "maximum context length")."""

from __future__ import annotations

import pytest

from omnirelay.errors import BadRequest
from omnirelay.gateway import generation
from omnirelay.gateway.config import ServedModel
from omnirelay.gateway.models import ModelRuntime
from omnirelay.gateway.schema import parse_chat, parse_completion

CONTEXT = 32


@pytest.fixture(scope="module")
def model(tiny_model):
    return ModelRuntime(ServedModel(name="tiny", path=tiny_model, max_model_len=CONTEXT))


def prepared(model, **fields) -> generation.Generation:
    return generation.prepare(model, parse_completion({"model": "tiny", **fields}), "cmpl")


@pytest.mark.parametrize("asked, expected", [(None, CONTEXT - 10), (10 ** 7, CONTEXT - 10), (CONTEXT - 9, CONTEXT - 10),
                                             (CONTEXT - 10, CONTEXT - 10), (5, 5)])
def test_max_tokens_is_clamped_to_the_room_left(model, asked, expected):
    gen = prepared(model, prompt=list(range(1, 11)), **({} if asked is None else {"max_tokens": asked}))
    assert gen.max_tokens == expected
    assert generation.text_params(gen, 0).max_tokens == expected   # what the workers are asked for


def test_the_chat_field_is_clamped_too(model):
    request = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "max_completion_tokens": 10 ** 6})
    gen = generation.prepare(model, request, "chatcmpl")
    assert gen.max_tokens == CONTEXT - gen.prompt_tokens > 0


@pytest.mark.parametrize("length", [CONTEXT, CONTEXT + 5])
def test_a_prompt_that_fills_the_context_is_still_a_400(model, length):
    with pytest.raises(BadRequest) as caught:
        prepared(model, prompt=[1] * length, max_tokens=1)
    assert caught.value.param == "prompt" and "maximum context length is 32 tokens" in caught.value.message
    with pytest.raises(BadRequest) as caught:
        generation.prepare(model, parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi " * 40}]}),
                           "chatcmpl")
    assert caught.value.param == "messages" and "maximum context length" in caught.value.message
