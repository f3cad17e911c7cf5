"""``/v1/responses`` through the official ``openai`` client against a real ``omni-serve`` of the
tiny random-weight LLM (the session's ``server``): the Responses answer is the chat path's answer
(greedy tokens compared with ``chat.completions`` on the same conversation), streamed with OpenAI's
typed events, with function tools, ``text.format``, ``previous_response_id`` and the store; a thinking
model's reasoning item (tiny-qwen3 with ``--reasoning-parser qwen3``); and the store's bounds on their
own (gateway/response_store.py)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests

from omnirelay.deploy.builders.qwen3 import cached_qwen3
from omnirelay.gateway.response_store import ResponseStore, StoreLimits

from conftest import ServeProcess

MODEL = "tiny-llm"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
YES_NO = {"type": "object", "properties": {"a": {"enum": ["yes", "no"]}}, "required": ["a"],
          "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}


def _chat(client, messages, max_tokens=8, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          **kwargs)


def test_text_answer_is_the_chat_answer(client):
    resp = client.responses.create(model=MODEL, input="Tell me a story.", instructions="Be brief.",
                                   max_output_tokens=8, temperature=0)
    chat = _chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}])
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    assert [item.type for item in resp.output] == ["message"]
    assert resp.output[0].role == "assistant" and resp.output[0].content[0].type == "output_text"
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.instructions == "Be brief." and resp.max_output_tokens == 8
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert resp.status == resp.output[0].status == expected
    if expected == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens"


def test_cut_at_max_output_tokens_is_incomplete(client):
    resp = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.output[0].status == "incomplete"


def test_stream_events_add_up_to_the_answer(client):
    kwargs = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
                  max_output_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == events[-4].text == final.output_text == whole.output_text
    assert final.usage.output_tokens == 10 and final.id == events[0].response.id
    # The SDK's own accumulator (it needs response.completed: a grammar that ends makes the answer end).
    short = dict(kwargs, extra_body={}, max_output_tokens=40,
                 text={"format": {"type": "json_schema", "name": "yn", "schema": YES_NO}})
    with client.responses.stream(**short) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and json.loads(final.output_text)["a"] in ("yes", "no")
    assert final.output_text == client.responses.create(**short).output_text


def test_function_tool_round_trip(client):
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL], max_output_tokens=40,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert first.status == "completed" and calls[0].status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    # The same call streamed: the arguments' deltas add up to the item's arguments.
    events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL], max_output_tokens=40,
                                          tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                          stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and args == done[0].arguments == calls[0].arguments
    assert events[-1].response.output[0].type == "function_call"
    # The tool's result goes back with previous_response_id; the model answers in text.
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[TOOL], max_output_tokens=6,
                                     temperature=0, tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": '{"forecast": "sun"}'}])
    assert second.previous_response_id == first.id and [i.type for i in second.output] == ["message"]
    chat = _chat(client, [{"role": "user", "content": "Weather in Paris?"},
                          {"role": "assistant", "content": "", "tool_calls": [
                              {"id": calls[0].call_id, "type": "function",
                               "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
                          {"role": "tool", "tool_call_id": calls[0].call_id, "content": '{"forecast": "sun"}'}],
                 max_tokens=6, tools=[{"type": "function", "function": {k: TOOL[k] for k in
                                                                        ("name", "description", "parameters")}}],
                 tool_choice="none")
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content


def test_required_tool_choice_gives_a_call(client):
    resp = client.responses.create(model=MODEL, input="Weather?", tools=[TOOL], tool_choice="required",
                                   max_output_tokens=60, temperature=0)
    assert resp.status == "completed" and [item.type for item in resp.output] == ["function_call"]
    jsonschema.validate(json.loads(resp.output[0].arguments), WEATHER)


def test_previous_response_id_carries_the_conversation(client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=5, temperature=0,
                                    instructions="Answer in French.")
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=5, temperature=0)
    # The instructions stay with the first response (as OpenAI does); the answer does not.
    chat = _chat(client, [{"role": "user", "content": "My name is Ada."},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "What is my name?"}], max_tokens=5)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content


def test_retrieve_delete_and_store_false(client, server):
    resp = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0)
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text and got.usage == resp.usage
    assert requests.delete(f"{server.url}/v1/responses/{resp.id}", timeout=10).json() == {
        "id": resp.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="again", previous_response_id=resp.id)
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(resp.id)
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}},
              "required": ["answer"], "additionalProperties": False}
    resp = client.responses.create(model=MODEL, input="Answer in JSON", max_output_tokens=40, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "reply", "schema": schema}})
    assert resp.text.format.type == "json_schema" and resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)


def test_logprobs_on_output_text(client):
    resp = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0, top_logprobs=2,
                                   include=["message.output_text.logprobs"], extra_body={"ignore_eos": True})
    logprobs = resp.output[0].content[0].logprobs
    assert len(logprobs) == 4 and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    chat = _chat(client, [{"role": "user", "content": "Hi"}], max_tokens=4, logprobs=True, top_logprobs=2,
                 extra_body={"ignore_eos": True})
    assert [(lp.token, lp.logprob) for lp in logprobs] == [(lp.token, lp.logprob)
                                                          for lp in chat.choices[0].logprobs.content]


@pytest.mark.parametrize("kwargs, status, param", [
    ({"background": True}, 422, "background"),
    ({"truncation": "auto"}, 422, "truncation"),
    ({"reasoning": {"summary": "auto"}}, 422, "reasoning.summary"),
    ({"reasoning": {"effort": "huge"}}, 400, "reasoning.effort"),
    ({"include": ["reasoning.encrypted_content"]}, 422, "include"),
    ({"tools": [{"type": "web_search"}]}, 422, "tools[0].type"),
    ({"extra_body": {"best_of": 2}}, 422, "best_of"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"temperature": 7}, 400, "temperature"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, 400,
     "text.format.schema"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 422, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 422,
     "input[0].content[0].type"),
])
def test_what_is_not_served_is_refused_by_name(client, kwargs, status, param):
    kwargs = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **kwargs}
    with pytest.raises(openai.APIStatusError) as err:
        client.responses.create(**kwargs)
    assert err.value.status_code == status and err.value.body["param"] == param, err.value.body


def test_store_evicts_least_recently_used_by_count_bytes_and_age():
    now = [0.0]
    store = ResponseStore(StoreLimits(max_responses=3, max_bytes=2000, ttl_s=10), clock=lambda: now[0])
    msgs = [{"role": "user", "content": "x" * 100}]
    for name in "abc":
        assert store.put({"id": name}, msgs)
    assert store.get("a") is not None        # a is now the most recent: b goes first
    store.put({"id": "d"}, msgs)
    assert [k for k in "abcd" if store.get(k)] == ["a", "c", "d"] and store.evicted == 1
    assert store.put({"id": "big"}, [{"role": "user", "content": "y" * 1700}])   # bytes: evicts until it fits
    assert store.nbytes <= 2000 and store.get("big") is not None and len(store) == 2 and store.evicted == 3
    assert not store.put({"id": "huge"}, [{"role": "user", "content": "z" * 3000}])   # alone over the bound
    now[0] = 11.0                             # past the TTL: gone, and swept by the next put
    assert store.get("big") is None and store.delete("big") is False
    assert store.put({"id": "e"}, msgs) and len(store) == 1 and store.nbytes == store.get("e").nbytes


# -- a thinking model (tiny-qwen3, --reasoning-parser qwen3) ----------------------------------------

THOUGHT = "<think>\nThe sky scatters blue light\n</think>\n\nYes"   # forced by a regex: the weights are random


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("responses-reasoning") / "serve.log")
    # The grammar shapes the reasoning too (--structured-outputs-in-reasoning): it forces the <think> block.
    with ServeProcess(str(cached_qwen3()), "--served-model-name", "tiny-qwen3", "--reasoning-parser", "qwen3",
                      "--structured-outputs-in-reasoning", "--log-level", "WARNING", log_path=log) as process:
        yield openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_reasoning_item_before_the_answer(thinking):
    kwargs = dict(model="tiny-qwen3", input="Is the sky blue?", max_output_tokens=64, temperature=0,
                  extra_body={"structured_outputs": {"regex": THOUGHT}})
    resp = thinking.responses.create(**kwargs)
    assert [item.type for item in resp.output] == ["reasoning", "message"] and resp.status == "completed"
    assert resp.output[0].content[0].type == "reasoning_text"
    assert resp.output[0].content[0].text == "\nThe sky scatters blue light\n"
    assert resp.output_text == "\n\nYes"
    chat = thinking.chat.completions.create(model="tiny-qwen3",
                                            messages=[{"role": "user", "content": "Is the sky blue?"}],
                                            max_tokens=64, temperature=0,
                                            extra_body={"structured_outputs": {"regex": THOUGHT}})
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    # The reasoning's tokens: up to the one that completes </think>, as the tokenizer splits the text.
    tokens = chat.usage.completion_tokens - len(_tokenizer()("\n\nYes", add_special_tokens=False)["input_ids"])
    assert 0 < resp.usage.output_tokens_details.reasoning_tokens <= tokens + 1
    events = list(thinking.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        resp.output[0].content[0].text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "\n\nYes"
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    # Thinking turned off through the template switch: no reasoning item.
    off = thinking.responses.create(model="tiny-qwen3", input="Is the sky blue?", max_output_tokens=4, temperature=0,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [item.type for item in off.output] == ["message"]


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(cached_qwen3()))


# -- the output items and their events, on text known in advance ------------------------------------

def _replay(events: list[dict]) -> list[dict]:
    """The output items as a client rebuilds them from the stream's events alone."""
    items: list[dict] = []
    for event in events:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert event["output_index"] == len(items)
            items.append(json.loads(json.dumps(event["item"])))
        elif kind == "response.content_part.added":
            items[event["output_index"]]["content"].append(dict(event["part"]))
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[event["output_index"]]["content"][event["content_index"]]["text"] += event["delta"]
        elif kind == "response.function_call_arguments.delta":
            items[event["output_index"]]["arguments"] += event["delta"]
        elif kind == "response.output_item.done":
            assert items[event["output_index"]]["status"] == "in_progress"
            items[event["output_index"]] = event["item"]
    return items


def _build(text: str, split: int, tools=None, reasoning=None, gen=None) -> tuple[list[dict], list[dict]]:
    from omnirelay.gateway.generation import TextChunk
    from omnirelay.gateway.responses_output import OutputBuilder

    builder = OutputBuilder(gen, tools, False, None, reasoning)
    pieces = [text[i:i + split] for i in range(0, len(text), split)] if split else [text]
    events = []
    for i, piece in enumerate(pieces):
        events += builder.feed(TextChunk(piece, [], "stop" if i == len(pieces) - 1 else ""))
    return builder.items, events


CALLS = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> done')


@pytest.mark.parametrize("split", [0, 1, 2, 5, 13])
def test_items_from_tool_markup_any_split(split):
    from omnirelay.gateway.structured import ToolsRequest

    tools = ToolsRequest(tuple({"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                               for n in ("get_weather", "get_time")), "auto")
    items, events = _build(CALLS, split, tools)
    assert _replay(events) == items
    assert [(i["type"], i.get("name") or i["content"][0]["text"]) for i in items] == [
        ("message", "Sure. "), ("function_call", "get_weather"), ("function_call", "get_time"),
        ("message", " done")]   # the whitespace between the calls makes no item
    assert json.loads(items[1]["arguments"]) == {"city": "Paris"} and items[2]["arguments"] == "{}"
    assert all(i["status"] == "completed" for i in items)


@pytest.mark.parametrize("split", [0, 1, 3, 7])
def test_reasoning_then_answer_any_split(split):
    from omnirelay.gateway.reasoning import ReasoningMode

    items, events = _build(THOUGHT, split, reasoning=ReasoningMode("qwen3"))
    assert _replay(events) == items
    assert [(i["type"], i["content"][0]["text"]) for i in items] == [
        ("reasoning", "\nThe sky scatters blue light\n"), ("message", "\n\nYes")]
    cut, events = _build("thinking still", split, reasoning=ReasoningMode("qwen3"))
    assert [i["type"] for i in cut] == ["reasoning"] and _replay(events) == cut
