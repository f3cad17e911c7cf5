"""Request options that change the answer: each is either served or refused (422 naming it), never
a 200 that ignored it. Through the official ``openai`` client against a real ``omni-serve``.
"""

from __future__ import annotations

import openai
import pytest

from omnirelay.errors import Unprocessable
from omnirelay.gateway.schema import NOT_SERVED, parse_chat, parse_completion

MODEL = "tiny-llm"

# One value per option that would change the answer (an option missing here fails the test below).
_ANSWER_CHANGING = {
    "presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3, "logit_bias": {"5": 100},
    "min_p": 0.1, "min_tokens": 4, "bad_words": ["the"], "allowed_token_ids": [1, 2, 3], "best_of": 2,
    "use_beam_search": True, "length_penalty": 0.5, "logits_processors": ["x"],
    "response_format": {"type": "json_object"}, "structured_outputs": {"json": {"type": "object"}},
    "guided_json": {"type": "object"}, "guided_regex": "[a-z]+", "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= \"a\"", "guided_decoding_backend": "xgrammar",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "required", "parallel_tool_calls": False,
    "functions": [{"name": "f", "parameters": {"type": "object"}}], "function_call": "auto",
    "prompt_logprobs": 1, "include_stop_str_in_output": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 8, "suffix": "end",
    "add_generation_prompt": False, "continue_final_message": True, "add_special_tokens": True,
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"enable_thinking": True},
    "return_tokens_as_token_ids": True, "reasoning_effort": "high", "web_search_options": {},
}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize("name", sorted(NOT_SERVED))
def test_an_option_not_served_is_a_422_naming_it(name):
    value = _ANSWER_CHANGING[name]
    for parse, body in ((parse_chat, _chat(**{name: value})),
                        (parse_completion, {"model": MODEL, "prompt": "hi", name: value})):
        with pytest.raises(Unprocessable) as caught:
            parse(body)
        assert caught.value.param == name and caught.value.status == 422


@pytest.mark.parametrize("name", sorted(NOT_SERVED))
def test_an_option_at_its_harmless_value_is_accepted(name):
    for value in (None, *NOT_SERVED[name]):
        parse_chat(_chat(**{name: value}))


def test_a_harmless_value_must_match_in_type_too():
    if "use_beam_search" in NOT_SERVED:
        with pytest.raises(Unprocessable):
            parse_chat(_chat(use_beam_search=0))


def test_hints_are_ignored():
    parse_chat(_chat(user="u", metadata={"k": "v"}, store=False, service_tier="auto",
                     prediction={"type": "content", "content": "x"}))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_not_served_through_the_openai_client(client):
    """Every option of the table, as a client sends it (``extra_body`` for vLLM's), gets a 422
    naming it, chat and completions alike."""
    for name in sorted(NOT_SERVED):
        value = _ANSWER_CHANGING[name]
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_body={name: value})
        assert caught.value.body["param"] == name, caught.value.body
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={name: value})
        assert caught.value.body["param"] == name, caught.value.body
