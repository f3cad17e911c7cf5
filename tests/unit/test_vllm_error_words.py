"""The words of the 400s that vLLM's clients (and vLLM's own server tests) match, in the project's
error shape (status, param): an empty prompt, token ids out of vocabulary, and a number out of its
range worded as vLLM's pydantic validation words it (``greater_than_equal``/``less_than_equal``)."""

from __future__ import annotations

import pytest

from omnirelay.errors import BadRequest, Unprocessable
from omnirelay.gateway import generation
from omnirelay.gateway.config import ServedModel
from omnirelay.gateway.models import ModelRuntime
from omnirelay.gateway.routes.tokenization import detokenize_body
from omnirelay.gateway.schema import parse_chat, parse_completion

EMPTY = "Either prompt or prompt_embeds must be provided and non-empty"
LONG_MIN, LONG_MAX = -2 ** 63, 2 ** 63 - 1


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "hi", **fields}


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}


def refused(parse, body) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        parse(body)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("prompt", [None, "", []])
@pytest.mark.parametrize("embeds", [None, []])
def test_an_empty_prompt_is_worded_as_vllm_words_it(prompt, embeds):
    body = completion(prompt=prompt, **({} if embeds is None else {"prompt_embeds": embeds}))
    error = refused(parse_completion, body)
    assert EMPTY in error.message and error.param == "prompt"


def test_prompt_embeds_are_not_served_rather_than_ignored():
    with pytest.raises(Unprocessable) as caught:
        parse_completion(completion(prompt_embeds="AAAA"))
    assert caught.value.param == "prompt_embeds"


@pytest.mark.parametrize("seed, words", [(LONG_MIN - 1, "greater_than_equal"), (LONG_MAX + 1, "less_than_equal")])
@pytest.mark.parametrize("parse, body", [(parse_chat, chat), (parse_completion, completion)])
def test_a_seed_beyond_64_bits_is_refused_in_pydantic_words(parse, body, seed, words):
    error = refused(parse, body(seed=seed))
    assert words in error.message and error.param == "seed"


@pytest.mark.parametrize("seed", [LONG_MIN, LONG_MAX, 0])
def test_every_64_bit_seed_is_taken(seed):
    assert parse_chat(chat(seed=seed)).seed == seed


@pytest.mark.parametrize("field, value, words", [
    ("temperature", 2.5, "less_than_equal"), ("temperature", -0.1, "greater_than_equal"),
    ("max_tokens", 0, "greater_than_equal"), ("n", 0, "greater_than_equal"),
    ("presence_penalty", 3, "less_than_equal"), ("repetition_penalty", 0, "greater_than"),
    ("top_logprobs", 10 ** 6, "less_than_equal"), ("priority", 2 ** 63, "less_than_equal")])
def test_numbers_out_of_range_say_which_bound(field, value, words):
    body = chat(**{field: value}, **({"logprobs": True} if field == "top_logprobs" else {}))
    error = refused(parse_chat, body)
    assert f"({words}:" in error.message and error.param == field


@pytest.fixture(scope="module")
def model(tiny_model):
    return ModelRuntime(ServedModel(name="tiny", path=tiny_model))


def test_token_ids_out_of_vocabulary_say_so(model):
    for body, param in ((completion(prompt=[1, 999999]), "prompt"),
                        (completion(stop_token_ids=[model.vocab_size]), "stop_token_ids")):
        with pytest.raises(BadRequest) as caught:
            generation.prepare(model, parse_completion(body), "cmpl")
        assert "out of vocabulary" in caught.value.message and caught.value.param == param
    with pytest.raises(BadRequest) as caught:
        detokenize_body(model, {"tokens": [model.vocab_size]})
    assert "out of vocabulary" in caught.value.message and caught.value.param == "tokens"
