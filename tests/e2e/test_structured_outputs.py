"""Structured outputs and tool calls end to end, through the official ``openai`` client against a
real ``omni-serve`` on the tiny model: gateway (checks and compiles the spec) → prefill (first
token under the grammar) → decode (the rest; its matcher rebuilt from prefill's token).

The tiny model's weights are random: whatever it says is valid only because the grammar made it so.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import requests
from transformers import AutoTokenizer

MODEL = "tiny-llm"
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                         "sunny": {"type": "boolean"},
                         "rating": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["city", "sunny", "rating"], "additionalProperties": False}
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, messages=ASK, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 96, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def streamed(client, messages=ASK, **kwargs) -> tuple[str, dict[int, dict], str]:
    """A streamed chat's content, its tool calls by index (arguments concatenated) and finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chat(client, messages, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += call.id or ""
            entry["name"] += (call.function.name or "") if call.function else ""
            entry["arguments"] += (call.function.arguments or "") if call.function else ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_json_schema_answer_validates_stream_equals_whole(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    full = chat(client, response_format=response_format)
    answer = full.choices[0].message.content
    assert full.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer), SCHEMA)
    content, calls, finish = streamed(client, response_format=response_format)
    assert (content, calls, finish) == (answer, {}, "stop")
    # Without the grammar the same prompt says something else entirely.
    assert chat(client).choices[0].message.content != answer


def test_json_object(client):
    full = chat(client, response_format={"type": "json_object"}, max_tokens=200)
    assert full.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(full.choices[0].message.content), dict)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"choice": ["positive", "negative", "neutral"]}}, "positive|negative|neutral"),
    ({"guided_choice": ["yes", "no"]}, "yes|no"),
    ({"structured_outputs": {"regex": r"[A-Z][a-z]{2,8} [0-9]{2}"}}, r"[A-Z][a-z]{2,8} [0-9]{2}"),
    ({"guided_regex": r"(cat|dog)s? (run|sleep)\."}, r"(cat|dog)s? (run|sleep)\."),
    ({"structured_outputs": {"grammar": 'root ::= "I like " thing "."\nthing ::= "tea" | "coffee"'}},
     r"I like (tea|coffee)\."),
    ({"guided_json": SCHEMA}, None),
])
def test_vllm_structured_outputs(client, extra, check):
    full = chat(client, extra_body=extra)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason == "stop"
    if check is None:
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert re.fullmatch(check, text), text


def test_completions_take_structured_outputs(client):
    full = client.completions.create(model=MODEL, prompt="The weather today:", max_tokens=96, temperature=0,
                                     extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(full.choices[0].text), SCHEMA)
    # Sampled, seeded: still valid, whatever the draw.
    sampled = client.completions.create(model=MODEL, prompt="Report:", max_tokens=96, temperature=1.0, seed=3,
                                        extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(sampled.choices[0].text), SCHEMA)


def test_named_tool_call_arguments_validate_stream_equals_whole(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    full = chat(client, tools=TOOLS, tool_choice=choice)
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls" and message.content is None
    [call] = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    content, calls, finish = streamed(client, tools=TOOLS, tool_choice=choice)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]


def test_required_tool_call_is_one_valid_call(client):
    full = chat(client, tools=TOOLS, tool_choice="required")
    [call] = full.choices[0].message.tool_calls
    assert full.choices[0].finish_reason == "tool_calls"
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    content, calls, finish = streamed(client, tools=TOOLS, tool_choice="required")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]
    assert finish == "tool_calls"


# The markup an "auto" answer may carry, produced here by a grammar (the random model never would).
MARKUP = ('root ::= "Let me check. <tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" '
          'city "\\", \\"days\\": " day "}}\\n</tool_call>" (" <tool_call>\\n{\\"name\\": \\"get_time\\", '
          '\\"arguments\\": {\\"zone\\": \\"UTC\\"}}\\n</tool_call>")?\ncity ::= "Paris" | "Rome"\nday ::= [1-7]')


def test_auto_parses_tool_call_markup_stream_equals_whole(client):
    extra = {"structured_outputs": {"grammar": MARKUP}, "max_tokens": 300}
    full = chat(client, tools=TOOLS, extra_body=extra)
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls"
    assert message.content.strip() == "Let me check."
    assert message.tool_calls[0].function.name == "get_weather"
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), {"get_weather": WEATHER, "get_time": TIME}[call.function.name])
    content, calls, finish = streamed(client, tools=TOOLS, extra_body=extra)
    assert content.strip() == "Let me check." and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls]
    # tool_choice "none": the same text is content, nothing parsed.
    plain = chat(client, tools=TOOLS, tool_choice="none", extra_body=extra)
    assert plain.choices[0].message.tool_calls is None and "<tool_call>" in plain.choices[0].message.content
    assert plain.choices[0].finish_reason == "stop"


def test_tools_and_tool_messages_go_through_the_chat_template(client, tiny_model):
    conversation = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": json.dumps({"city": "Paris", "days": 1})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    full = chat(client, conversation, tools=TOOLS, max_tokens=4)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    template_messages = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Paris", "days": 1}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    text = tok.apply_chat_template(template_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in text and '"name": "get_time"' in text
    assert full.usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])


def _prompt_tokens_total(server) -> float:
    text = requests.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prompt_tokens_total"))


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"guided_regex": "(?<=a)b"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools[0].function.parameters"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
])
def test_bad_specs_are_400_naming_the_param_and_reach_no_worker(client, server, extra, param):
    before = _prompt_tokens_total(server)
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, extra_body=extra)
    assert caught.value.body["param"] == param, caught.value.body
    assert _prompt_tokens_total(server) == before


def test_unserved_shapes_are_422(client):
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        chat(client, extra_body={"structured_outputs": {"structural_tag": "{}"}})
    assert caught.value.body["param"] == "structured_outputs.structural_tag"
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        chat(client, extra_body={"guided_decoding_backend": "outlines", "guided_regex": "a+"})
    assert caught.value.body["param"] == "guided_decoding_backend"


def test_every_choice_is_constrained_and_parsed(client):
    """n choices, sampled: each one under the grammar, each one's tool call parsed on its own."""
    full = chat(client, n=3, temperature=1.0, seed=5, tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert len(full.choices) == 3
    for choice in full.choices:
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and choice.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    full = chat(client, n=2, temperature=1.0, seed=5,
                response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}})
    for choice in full.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
