"""The defects issue #26 found by sending the same requests to vLLM 0.32 and to us, each answered as
vLLM answers it now: end to end through the official ``openai`` client against a real
``omni-serve`` (the session's tiny-llm), and the tool-call parser and voice lookup on their own."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from omnirelay.deploy.builders.qwen3_tts import cached_tiny_qwen3_tts
from omnirelay.errors import BadRequest
from omnirelay.gateway.config import ServedModel
from omnirelay.gateway.models import ModelRuntime
from omnirelay.gateway.routes.speech import _speech_params, voices
from omnirelay.gateway.structured import ToolsRequest
from omnirelay.gateway.tool_calls import ToolCallFormat

MODEL = "tiny-llm"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def _error(server, route: str, body: dict) -> tuple[int, dict]:
    reply = requests.post(server.url + route, json={"model": MODEL, **body}, timeout=60)
    return reply.status_code, reply.json().get("error", {})


def test_stop_token_ids_outside_the_vocabulary_are_a_400(server):
    status, error = _error(server, "/v1/chat/completions",
                           {"messages": ASK, "max_tokens": 2, "stop_token_ids": [3, 10**6, 10**7]})
    assert status == 400 and error["param"] == "stop_token_ids"
    assert "1000000" in error["message"] and "10000000" in error["message"]


def test_stream_options_need_a_stream(server):
    status, error = _error(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                                       "stream_options": {"include_usage": True}})
    assert status == 400 and error["param"] == "stream_options"
    reply = requests.post(server.url + "/v1/completions", timeout=60,   # an empty object passes, as in vLLM
                          json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream_options": {}})
    assert reply.status_code == 200


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats_put_usage_on_every_chunk(client, route):
    options = {"include_usage": True, "continuous_usage_stats": True}
    if route == "chat":
        stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0,
                                                stream=True, stream_options=options, extra_body={"ignore_eos": True})
    else:
        stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=6, temperature=0, stream=True,
                                           stream_options=options, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(chunk.usage is not None for chunk in chunks)
    completion = [chunk.usage.completion_tokens for chunk in chunks]
    assert completion == sorted(completion) and completion[-1] == 6
    assert {chunk.usage.prompt_tokens for chunk in chunks} == {chunks[-1].usage.prompt_tokens}
    assert chunks[-1].choices == []
    plain = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True,
                                      stream_options={"include_usage": True})
    usages = [chunk.usage for chunk in plain]   # without it: usage on the last chunk only
    assert len(usages) > 1 and all(u is None for u in usages[:-1]) and usages[-1] is not None


def test_every_bad_logit_bias_key_is_named(server):
    status, error = _error(server, "/v1/chat/completions",
                           {"messages": ASK, "max_tokens": 2, "logit_bias": {"x": 1, "5": 1, "y": 2, "7": 500}})
    assert status == 400 and error["param"] == "logit_bias"
    assert all(repr(key) in error["message"] for key in ("x", "y", "7"))
    status, error = _error(server, "/v1/chat/completions",
                           {"messages": ASK, "max_tokens": 2, "logit_bias": {"999999": 1, "888888": -1}})
    assert status == 400 and "888888" in error["message"] and "999999" in error["message"]


def test_chat_return_token_ids_puts_the_prompt_ids_on_top_and_in_the_first_chunk(client):
    answer = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0,
                                            extra_body={"return_token_ids": True})
    prompt_ids = answer.model_extra["prompt_token_ids"]
    assert len(prompt_ids) == answer.usage.prompt_tokens and "prompt_token_ids" not in answer.choices[0].model_extra
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0, stream=True,
                                                 extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in chunk.model_extra for chunk in chunks[1:])
    assert [t for c in chunks for ch in c.choices for t in ch.model_extra.get("token_ids") or []] == \
        answer.choices[0].model_extra["token_ids"]
    several = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, n=2,
                                             extra_body={"return_token_ids": True})
    assert several.model_extra["prompt_token_ids"] == prompt_ids
    # A completion choice keeps its own prompt's ids, in its first streamed chunk too (vLLM).
    streamed = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True,
                                              extra_body={"return_token_ids": True}))
    assert streamed[0].choices[0].model_extra["prompt_token_ids"] and \
        all("prompt_token_ids" not in c.choices[0].model_extra for c in streamed[1:] if c.choices)


def _call(answer):
    message = answer.choices[0].message
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []], answer.choices[0].finish_reason


def test_a_required_call_cut_at_max_tokens_answers_like_a_named_one(client):
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0, tools=TOOLS,
                                           tool_choice="required", extra_body={"return_token_ids": True})
    (name, arguments), = _call(whole)[0]
    cut = len(whole.choices[0].model_extra["token_ids"]) - 4   # greedy: the same answer, its last 4 tokens short
    required = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=cut, temperature=0, tools=TOOLS,
                                              tool_choice="required")
    calls, finish = _call(required)
    assert finish == "length" and len(calls) == 1 and calls[0][0] == name == "get_weather"
    partial = calls[0][1]
    assert partial.startswith('{"city": "') and json.loads(arguments)
    with pytest.raises(ValueError):
        json.loads(partial)
    assert required.choices[0].message.content is None
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=cut, temperature=0, tools=TOOLS,
                                            tool_choice="required", stream=True)
    streamed = [call for chunk in stream for choice in chunk.choices for call in choice.delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == calls


def test_a_named_call_cut_before_its_arguments_is_no_call(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, temperature=0, tools=TOOLS,
                                            tool_choice=named)
    assert _call(answer) == ([], "length")
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, temperature=0, tools=TOOLS,
                                            tool_choice=named, stream=True)
    assert not [c for chunk in stream for choice in chunk.choices for c in choice.delta.tool_calls or []]


def test_required_with_defs_and_refs_compiles(client):
    parameters = {"type": "object", "$defs": {"City": {"type": "string", "enum": ["Paris", "Rome"]}},
                  "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
                  "additionalProperties": False}
    other = {"type": "object", "definitions": {"Zone": {"enum": ["UTC"]}},
             "properties": {"zone": {"$ref": "#/definitions/Zone"}}, "required": ["zone"],
             "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}},
             {"type": "function", "function": {"name": "get_time", "parameters": other}}]
    answer = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=tools,
                                            tool_choice="required")
    assert answer.choices[0].finish_reason == "tool_calls"
    (name, arguments), = _call(answer)[0]
    assert (name, json.loads(arguments)) in [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"}),
                                             ("get_time", {"zone": "UTC"})]


def test_a_forced_call_wins_over_response_format(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS, tool_choice="required",
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})
    calls, finish = _call(answer)
    assert finish == "tool_calls" and calls[0][0] == "get_weather" and json.loads(calls[0][1])["city"] in ("Paris", "Rome")
    with pytest.raises(openai.BadRequestError) as raised:   # vLLM refuses this pair too
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       extra_body={"structured_outputs": {"regex": "a+"}})
    assert raised.value.body["param"] == "structured_outputs"


def test_named_parser_holds_a_lone_brace():
    tools = ToolsRequest(tuple(TOOLS), "named", "get_weather")
    assert ToolCallFormat(_Base(), tools).full("{", "length")["message"].get("tool_calls") is None
    fmt = ToolCallFormat(_Base(), tools)
    assert fmt.delta(" {", None)["delta"] == {}
    first = fmt.delta('"city"', None)["delta"]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": ' {"city"'}


class _Base:
    object_full, object_chunk, logprobs = "chat.completion", "chat.completion.chunk", None

    def first_delta(self):
        return None


def test_voice_names_match_whatever_their_case():
    path = str(cached_tiny_qwen3_tts())
    model = ModelRuntime(ServedModel(name="tts", path=path, stages=("prefill", "decode", "generate")))
    stored = voices(model)[0]
    assert stored == stored.lower()
    assert _speech_params(model, stored.title(), "wav", {}).voice == stored
    assert _speech_params(model, stored.upper(), "wav", {}).voice == stored
    with pytest.raises(BadRequest):
        _speech_params(model, "nobody", "wav", {})
