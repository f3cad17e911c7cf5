"""``--tool-call-parser qwen3_coder``: Qwen3-Coder's XML tool-call markup read into OpenAI's
``tool_calls``, each parameter converted by its tool's JSON schema type (gateway/tool_call_formats.py).

The reader on text split every way a stream could split it, then end to end through the official
``openai`` client against ``omni-serve`` on the tiny model, whose answer is made to be the markup by
a grammar (its random weights never would write it)."""

from __future__ import annotations

import json

import openai
import pytest

from omnirelay.gateway.daemon import build_parser, served_models
from omnirelay.gateway.structured import ToolsRequest
from omnirelay.gateway.tool_call_formats import convert_value
from omnirelay.gateway.tool_calls import ToolCallFormat

from conftest import ServeProcess

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                          "scale": {"type": "number"}, "hours": {"type": "array"}, "where": {"type": "object"},
                          "note": {"type": ["integer", "string"]}}}
TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time",
                                           "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}})

CALLS = ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=scale>\n1.5\n"
         "</parameter>\n<parameter=hours>\n[6, 12]\n</parameter>\n<parameter=where>\n{'lat': 40.7}\n</parameter>\n"
         "<parameter=note>\nsoon\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n<function=get_time>\n<parameter=zone>\n two\nlines \n</parameter>\n</function>\n</tool_call> ok")
EXPECTED = [("get_weather", {"city": "New York", "days": 3, "metric": True, "scale": 1.5, "hours": [6, 12],
                             "where": {"lat": 40.7}, "note": "soon"}),
            ("get_time", {"zone": " two\nlines "})]


class _Base:
    object_full, object_chunk = "chat.completion", "chat.completion.chunk"
    logprobs = None

    def first_delta(self):
        return None


def _run(text: str, split: int, parallel: bool = True) -> tuple[dict, dict]:
    """(whole answer's choice, the stream's content and calls) for ``text`` in ``split``-char pieces."""
    tools = ToolsRequest(TOOLS, "auto", "", parallel)
    full = ToolCallFormat(_Base(), tools, "qwen3_coder").full(text, "stop")
    stream = ToolCallFormat(_Base(), tools, "qwen3_coder")
    pieces = [text[i:i + split] for i in range(0, len(text), split)] if split else [text]
    content, calls, finish = "", [], None
    for i, piece in enumerate(pieces):
        delta = stream.delta(piece, "stop" if i == len(pieces) - 1 else None)
        content += delta["delta"].get("content", "")
        calls += [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                  for c in delta["delta"].get("tool_calls", [])]
        finish = delta["finish_reason"]
    return full, {"content": content, "calls": calls, "finish": finish}


@pytest.mark.parametrize("split", [0, 1, 2, 3, 7, 13])
def test_xml_calls_any_split(split):
    full, streamed = _run(CALLS, split)
    whole = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in full["message"]["tool_calls"]]
    assert whole == streamed["calls"] == EXPECTED
    assert full["message"]["content"] == streamed["content"] == "Let me check.\n\n ok"
    assert full["finish_reason"] == streamed["finish"] == "tool_calls"


def test_not_a_call_stays_content():
    for text in ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',      # hermes JSON: not this markup
                 "<tool_call><function=launch><parameter=x>1</parameter></function></tool_call>",   # no such tool
                 "<tool_call><function=get_time></function>",                          # never closed
                 "<tool_call>hello <function=get_time></function></tool_call>"):       # text beside the call
        full, streamed = _run(text, 3)
        assert "tool_calls" not in full["message"] and streamed["calls"] == []
        assert full["message"]["content"] == streamed["content"] == text and full["finish_reason"] == "stop"
    # parallel_tool_calls false keeps the first call; tags left open at a parameter or function still parse
    full, _ = _run("<tool_call><function=get_time><parameter=zone>UTC</function></tool_call>" + CALLS, 5, False)
    assert [c["function"]["name"] for c in full["message"]["tool_calls"]] == ["get_time"]
    assert json.loads(full["message"]["tool_calls"][0]["function"]["arguments"]) == {"zone": "UTC"}


@pytest.mark.parametrize("text, schema, value", [
    ("null", {"type": "integer"}, None), ("NULL", {"type": "string"}, None),
    ("7", {"type": "integer"}, 7), ("seven", {"type": "integer"}, "seven"), ("2.0", {"type": "number"}, 2),
    ("-0.25", {"type": "number"}, -0.25), ("nan", {"type": "number"}, "nan"),
    ("TRUE", {"type": "boolean"}, True), ("no", {"type": "boolean"}, False),
    ('{"a": [1]}', {"type": "object"}, {"a": [1]}), ("(1, 2)", {"type": "array"}, [1, 2]),
    ("{1, 2}", {"type": "array"}, "{1, 2}"), ("[1,", {"type": "array"}, "[1,"), ("NaN", {"type": "array"}, "NaN"),
    ("42", None, "42"), ("42", {"description": "no type"}, "42"), ("42", {"type": ["null", "integer"]}, 42),
    ("x", {"type": ["integer", "null"]}, "x")])
def test_values_follow_the_schema_type(text, schema, value):
    assert convert_value(text, schema) == value and type(convert_value(text, schema)) is type(value)


def test_parser_per_model(tiny_model):
    def served(count: int, *flags: str):
        return served_models(build_parser().parse_args([*["--model", tiny_model] * count, *flags]))

    models = served(2, "--served-model-name", "a", "--served-model-name", "b",
                    "--tool-call-parser", "hermes", "--tool-call-parser", "qwen3_coder")
    assert [m.tool_call_parser for m in models] == ["hermes", "qwen3_coder"]
    assert [m.tool_call_parser for m in served(1)] == ["hermes"]
    with pytest.raises(ValueError, match="--tool-call-parser"):
        served(3, "--tool-call-parser", "hermes", "--tool-call-parser", "qwen3_coder")


# -- end to end --------------------------------------------------------------------------------------

MODEL = "coder-llm"
# The answer a Qwen3-Coder model writes for a call, made here by a grammar.
MARKUP = ('root ::= "Checking.\\n<tool_call>\\n<function=get_weather>\\n<parameter=city>\\n" city '
          '"\\n</parameter>\\n<parameter=days>\\n" day "\\n</parameter>\\n</function>\\n</tool_call>"\n'
          'city ::= "Paris" | "Rome"\nday ::= [1-7]')


@pytest.fixture(scope="module")
def client(tiny_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("qwen3-coder") / "serve.log")
    with ServeProcess(tiny_model, "--served-model-name", MODEL, "--tool-call-parser", "qwen3_coder",
                      log_path=log) as serve:
        yield openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=list(TOOLS),
        temperature=0, max_tokens=200, extra_body={"structured_outputs": {"grammar": MARKUP}}, **kwargs)


def test_served_xml_call_stream_equals_whole(client):
    full = _chat(client)
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls" and message.content == "Checking.\n"
    (call,) = message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert arguments["city"] in ("Paris", "Rome") and isinstance(arguments["days"], int)   # converted by type
    content, calls, finish = "", [], None
    for chunk in _chat(client, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += [(c.function.name, c.function.arguments) for c in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    assert (content, calls, finish) == (message.content, [(call.function.name, call.function.arguments)], "tool_calls")
    # Without tools the same answer is text.
    plain = _chat(client, tool_choice="none").choices[0].message
    assert plain.tool_calls is None and "<function=get_weather>" in plain.content
