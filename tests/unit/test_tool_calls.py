"""The tool-call parser of gateway/tool_calls.py on text, split every way a stream could split it:
the streamed deltas always add up to the whole answer's message."""

from __future__ import annotations

import json

import pytest

from omnirelay.gateway.structured import ToolsRequest
from omnirelay.gateway.tool_calls import ToolCallFormat

TOOLS = tuple({"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
              for n in ("get_weather", "get_time"))


class _Base:
    object_full, object_chunk = "chat.completion", "chat.completion.chunk"
    logprobs = None

    def first_delta(self):
        return None


def run(text: str, choice: str = "auto", name: str = "", parallel: bool = True, finish: str = "stop",
        split: int = 0) -> tuple[dict, dict]:
    """(whole answer's choice, the stream's deltas merged) for ``text`` streamed in ``split``-char pieces."""
    tools = ToolsRequest(TOOLS, choice, name, parallel)
    full = ToolCallFormat(_Base(), tools).full(text, finish)
    fmt = ToolCallFormat(_Base(), tools)
    pieces = [text[i:i + split] for i in range(0, len(text), split)] if split else [text]
    content, calls, last = "", {}, None
    for i, piece in enumerate(pieces):
        delta = fmt.delta(piece, finish if i == len(pieces) - 1 else None)
        content += delta["delta"].get("content", "")
        for call in delta["delta"].get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call.get("function", {}).get("name", "")
            entry["arguments"] += call.get("function", {}).get("arguments", "")
        last = delta["finish_reason"]
    return full, {"content": content, "calls": list(calls.values()), "finish": last}


def message_calls(full: dict) -> list[dict]:
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in full["message"].get("tool_calls", [])]


TWO_CALLS = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call> done')


@pytest.mark.parametrize("split", [0, 1, 2, 3, 5, 11])
def test_auto_markup_any_split(split):
    full, streamed = run(TWO_CALLS, split=split)
    assert full["finish_reason"] == streamed["finish"] == "tool_calls"
    assert message_calls(full) == streamed["calls"] == [
        {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
        {"name": "get_time", "arguments": json.dumps({"zone": "UTC"})}]
    assert full["message"]["content"] == streamed["content"] == "Sure. \n done"
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in full["message"]["tool_calls"])


@pytest.mark.parametrize("text", [
    "no calls at all <tool", "<tool_call>{not json}</tool_call>", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {}}', "a < b and <tool_callx> too"])
def test_what_is_not_a_call_stays_content(text):
    for split in (0, 1, 4):
        full, streamed = run(text, split=split)
        assert full["message"]["content"] == streamed["content"] == text
        assert "tool_calls" not in full["message"] and streamed["calls"] == []
        assert full["finish_reason"] == streamed["finish"] == "stop"


def test_parallel_false_keeps_the_first_call():
    full, streamed = run(TWO_CALLS, parallel=False, split=3)
    assert [c["name"] for c in message_calls(full)] == [c["name"] for c in streamed["calls"]] == ["get_weather"]


def test_named_streams_arguments_as_they_come():
    args = '{"city": "Rome", "days": 3}'
    for split in (0, 1, 7):
        full, streamed = run(args, choice="named", name="get_weather", split=split)
        assert message_calls(full) == streamed["calls"] == [{"name": "get_weather", "arguments": args}]
        assert full["message"]["content"] is None and streamed["content"] == ""
        assert full["finish_reason"] == streamed["finish"] == "tool_calls"
    # Cut short by max_tokens: the call is there, its arguments partial, the finish says so.
    full, _ = run(args[:9], choice="named", name="get_weather", finish="length")
    assert full["finish_reason"] == "length" and message_calls(full)[0]["arguments"] == args[:9]


def test_required_is_one_call_sent_whole():
    text = '{"name": "get_time", "arguments": {"zone": "CET"}}'
    for split in (0, 2):
        full, streamed = run(text, choice="required", split=split)
        assert message_calls(full) == streamed["calls"] == [{"name": "get_time", "arguments": '{"zone": "CET"}'}]
    # Cut short by max_tokens (issue #26): like a named choice, the call with its arguments as far as they got…
    for split in (0, 2):
        full, streamed = run(text[:45], choice="required", finish="length", split=split)
        assert message_calls(full) == streamed["calls"] == [{"name": "get_time", "arguments": '{"zone": "C'}]
        assert full["finish_reason"] == streamed["finish"] == "length" and streamed["content"] == ""
    # …and no call (no unparseable text either) before the arguments begin.
    full, streamed = run(text[:20], choice="required", finish="length", split=2)
    assert full["message"]["content"] == streamed["content"] == "" and streamed["calls"] == [] == message_calls(full)
