"""Thinking models (issue #26): the reasoning split from the answer (gateway/reasoning.py), the
grammar that starts after the reasoning (workers/llm/structured_output.py) and the chat template
switches, through the official ``openai`` client against a real ``omni-serve`` on tiny-qwen3
(Qwen3's chat template, ``--reasoning-parser qwen3``).

The tiny model's weights are random: a regex structured output makes it write a ``<think>`` block
(the server runs with ``--structured-outputs-in-reasoning``, so the grammar shapes the reasoning
too), so the split is checked on an answer known in advance.
"""

from __future__ import annotations

import json

import openai
import pytest
import requests



import torch
from transformers import AutoTokenizer

from omnirelay.request_params import StructuredOutput
from omnirelay.deploy.builders.qwen3 import cached_qwen3
from omnirelay.gateway.daemon import build_parser, served_models
from omnirelay.gateway.reasoning import ReasoningFormat, ReasoningMode, closed_in_prompt, split_whole
from omnirelay.pipeline import PipelineError, parse_pipeline
from omnirelay.workers.llm.structured_output import GrammarCompilerCache, GrammarSampler

from conftest import ServeProcess

MODEL = "tiny-qwen3"
ASK = [{"role": "user", "content": "Is the sky blue?"}]
THOUGHT = "<think>\nThe sky scatters blue light\n</think>\n\nYes"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


# -- the split on text, every way a stream could cut it ---------------------------------------------

class _Chat:
    object_full, object_chunk, logprobs = "chat.completion", "chat.completion.chunk", None

    def first_delta(self):
        return None

    def delta(self, text, finish, logprobs=None):
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": logprobs, "finish_reason": finish}

    def full(self, text, finish, logprobs=None):
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}


def _streamed(mode: ReasoningMode, text: str, split: int) -> tuple[str, str]:
    fmt = ReasoningFormat(_Chat(), mode)
    pieces = [text[i:i + split] for i in range(0, len(text), split)] if split else [text]
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        delta = fmt.delta(piece, "stop" if i == len(pieces) - 1 else None)["delta"]
        reasoning += delta.get("reasoning", "")
        content += delta.get("content", "")
    return reasoning, content


@pytest.mark.parametrize("split", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("text, reasoning, answer", [
    (THOUGHT, "\nThe sky scatters blue light\n", "\n\nYes"),
    ("no tags, cut while thinking", "no tags, cut while thinking", ""),        # qwen3: no </think>: reasoning
    ("deep thought</think>42", "deep thought", "42"),                         # the prompt opened the block
    ("<thin</think>x", "<thin", "x"),                                          # a tag's prefix that is not one
])
def test_split_any_cut(text, reasoning, answer, split):
    mode = ReasoningMode("qwen3")
    assert split_whole(mode, text) == (reasoning, answer)
    assert _streamed(mode, text, split) == (reasoning, answer)


def test_split_modes():
    # The prompt closed the block (enable_thinking false in Qwen3's template): all of it is the answer.
    assert split_whole(ReasoningMode("qwen3", closed_in_prompt=True), THOUGHT) == ("", THOUGHT)
    # Thinking off but no closed block in the prompt, no </think> in the output: qwen3 reads an answer.
    assert split_whole(ReasoningMode("qwen3", thinking_off=True), "plain") == ("", "plain")
    assert split_whole(ReasoningMode("deepseek_r1", thinking_off=True), "plain") == ("plain", "")
    full = ReasoningFormat(_Chat(), ReasoningMode("qwen3", include=False)).full(THOUGHT, "stop")
    assert full["message"] == {"role": "assistant", "content": "\n\nYes", "reasoning": None}
    assert closed_in_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not closed_in_prompt("<think>a</think> then <think>\n") and not closed_in_prompt("plain")


def test_reasoning_parser_from_pipeline_file_and_flag(tmp_path):
    model = str(cached_qwen3())
    pipeline = tmp_path / "thinking.yaml"
    pipeline.write_text(json.dumps({
        "reasoning_parser": "deepseek_r1", "stages": [{"role": "prefill"}, {"role": "decode"}],
        "connectors": {"kv": {"type": "shared_memory"}}, "edges": [{"from": "prefill", "to": "decode",
                                                                       "connector": "kv"}]}))
    def served(*flags: str):
        return served_models(build_parser().parse_args(["--model", model, *flags]))

    assert served("--stage-configs-path", str(pipeline))[0].reasoning_parser == "deepseek_r1"
    assert served("--stage-configs-path", str(pipeline), "--reasoning-parser", "qwen3")[0].reasoning_parser == "qwen3"
    assert served("--stage-configs-path", str(pipeline), "--reasoning-parser", "")[0].reasoning_parser is None
    assert served()[0].reasoning_parser is None
    with pytest.raises(PipelineError, match="reasoning_parser"):
        parse_pipeline({"reasoning_parser": "granite", "stages": [{"role": "prefill"}]})
    kwargs = served("--default-chat-template-kwargs", '{"enable_thinking": false}')
    assert kwargs[0].default_chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ValueError, match="JSON object"):
        served("--default-chat-template-kwargs", "[1]")


# -- end to end --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("reasoning") / "serve.log")
    with ServeProcess(str(cached_qwen3()), "--served-model-name", MODEL, "--reasoning-parser", "qwen3",
                      "--structured-outputs-in-reasoning", log_path=log) as process:
        yield process


@pytest.fixture(scope="module")
def client(serve):
    return openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _forced(client, pattern: str = THOUGHT, **extra):
    return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0,
                                          extra_body={"structured_outputs": {"regex": pattern}, **extra})


def test_reasoning_split_non_stream(client):
    answer = _forced(client)
    message = answer.choices[0].message
    assert message.model_extra["reasoning"] == "\nThe sky scatters blue light\n"
    assert message.content == "\n\nYes" and answer.choices[0].finish_reason == "stop"
    hidden = _forced(client, include_reasoning=False).choices[0].message
    assert hidden.model_extra["reasoning"] is None and hidden.content == "\n\nYes"


def test_reasoning_split_stream(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0, stream=True,
                                            extra_body={"structured_outputs": {"regex": THOUGHT}})
    reasoning = content = ""
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += choice.delta.model_extra.get("reasoning") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("\nThe sky scatters blue light\n", "\n\nYes")


def test_tool_calls_are_parsed_after_the_reasoning(client):
    forced = '<think>\nI need the weather\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": ' \
             '{"city": "Paris"}}\n</tool_call>'
    answer = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=96, temperature=0, tools=TOOLS,
        extra_body={"structured_outputs": {"regex": forced.replace("{", r"\{").replace("}", r"\}")}})
    message = answer.choices[0].message
    assert message.model_extra["reasoning"] == "\nI need the weather\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert answer.choices[0].finish_reason == "tool_calls"


def _tokenize(serve, **body) -> dict:
    reply = requests.post(serve.url + "/tokenize", json={"model": MODEL, "messages": ASK, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_enable_thinking_false_closes_the_block_in_the_prompt(serve, client):
    on = _tokenize(serve)
    off = _tokenize(serve, chat_template_kwargs={"enable_thinking": False})
    tail = requests.post(serve.url + "/detokenize", json={"model": MODEL, "tokens": off["tokens"][on["count"]:]},
                         timeout=60).json()["prompt"]
    assert off["tokens"][:on["count"]] == on["tokens"] and tail == "<think>\n\n</think>\n\n"
    answer = _forced(client, chat_template_kwargs={"enable_thinking": False})
    assert answer.usage.prompt_tokens == off["count"]
    assert answer.choices[0].message.content == THOUGHT   # the prompt closed the block: all of it is the answer
    assert answer.choices[0].message.model_extra["reasoning"] is None


def test_earlier_reasoning_leaves_the_prompt(serve):
    turns = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello!", "reasoning": "a greeting"},
             {"role": "user", "content": "Again"}]
    with_reasoning = _tokenize(serve, messages=turns)
    without = _tokenize(serve, messages=[{**m, "reasoning": None} if m["role"] == "assistant" else m for m in turns])
    assert with_reasoning["tokens"] == without["tokens"]
    # After the last user message (a tool loop in progress) the template keeps it.
    open_turn = _tokenize(serve, messages=turns[:2], add_generation_prompt=False)
    assert open_turn["count"] > _tokenize(serve, messages=[turns[0], {"role": "assistant", "content": "Hello!"}],
                                          add_generation_prompt=False)["count"]


def test_template_switches(serve, client):
    cont = _tokenize(serve, messages=[*ASK, {"role": "assistant", "content": "Yes, it"}], continue_final_message=True)
    text = requests.post(serve.url + "/detokenize", json={"model": MODEL, "tokens": cont["tokens"]},
                         timeout=60).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nYes, it")
    answer = client.chat.completions.create(
        model=MODEL, messages=[*ASK, {"role": "assistant", "content": "Yes, it"}], max_tokens=2, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert answer.usage.prompt_tokens == cont["count"]
    bare = _tokenize(serve, add_generation_prompt=False)
    assert bare["count"] < _tokenize(serve)["count"]
    for body, param, status in [
            ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", 400),
            ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs", 400),
            ({"chat_template": "{{ messages[0].content }}"}, "chat_template", 422),
            ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message", 400)]:
        for url in ("/v1/chat/completions", "/tokenize"):
            reply = requests.post(serve.url + url, json={"model": MODEL, "messages": ASK, "max_tokens": 2, **body},
                                  timeout=60)
            assert reply.status_code == status and reply.json()["error"]["param"] == param, (url, body, reply.text)
    # A variable the template does not read is passed through as vLLM does; the log names it once.
    for url in ("/v1/chat/completions", "/tokenize", "/v1/chat/completions"):
        reply = requests.post(serve.url + url, json={"model": MODEL, "messages": ASK, "max_tokens": 2,
                                                     "chat_template_kwargs": {"no_such_variable": 1}}, timeout=60)
        assert reply.status_code == 200, reply.text
    assert serve.output().count("'no_such_variable'") == 1
    reply = requests.post(serve.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                               "chat_template_kwargs": {"enable_thinking": False}},
                          timeout=60)
    assert reply.status_code == 422 and reply.json()["error"]["param"] == "chat_template_kwargs"


def test_request_chat_template_behind_the_flag(tmp_path):
    with ServeProcess(str(cached_qwen3()), "--served-model-name", MODEL, "--trust-request-chat-template",
                      "--default-chat-template-kwargs", '{"enable_thinking": false}',
                      log_path=str(tmp_path / "serve.log")) as serve:
        mine = _tokenize(serve, chat_template="{{ 'Q: ' + messages[0].content + ' A:' }}")
        text = requests.post(serve.url + "/detokenize", json={"model": MODEL, "tokens": mine["tokens"]},
                             timeout=60).json()["prompt"]
        assert text == "Q: Is the sky blue? A:"
        # The server's default variables apply (thinking off: the empty block); a request's own override them.
        default, on = _tokenize(serve), _tokenize(serve, chat_template_kwargs={"enable_thinking": True})
        assert default["tokens"][:on["count"]] == on["tokens"] and default["count"] > on["count"]


def test_the_grammar_starts_after_the_reasoning(tmp_path):
    """Without --structured-outputs-in-reasoning a thinking model's grammar waits for </think>: the
    random model never writes it, so its answer runs free to max_tokens, all of it reasoning; with
    thinking off (the prompt closed the block) the grammar holds from the first token."""
    with ServeProcess(str(cached_qwen3()), "--served-model-name", MODEL, "--reasoning-parser", "qwen3",
                      log_path=str(tmp_path / "serve.log")) as serve:
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        free = _forced(client, "(Yes|No)", ignore_eos=True, max_tokens=12)
        assert free.choices[0].finish_reason == "length" and free.usage.completion_tokens == 12
        assert free.choices[0].message.model_extra["reasoning"] and free.choices[0].message.content is None
        held = _forced(client, "(Yes|No)", chat_template_kwargs={"enable_thinking": False})
        assert held.choices[0].message.content in ("Yes", "No") and held.choices[0].finish_reason == "stop"


def test_grammar_sampler_waits_for_the_marker():
    path = str(cached_qwen3())
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = json.loads(open(f"{path}/config.json").read())["vocab_size"]
    grammars = GrammarSampler(GrammarCompilerCache(path, vocab, (tokenizer.eos_token_id,)))
    marker = tuple(tokenizer("</think>", add_special_tokens=False)["input_ids"])
    spec = StructuredOutput("regex", "(Yes|No)", marker)
    logits = torch.zeros(1, vocab)
    row = grammars.row("r1", spec, [1, 2], 0)
    grammars.prepare(row)
    thought = tokenizer("hmm", add_special_tokens=False)["input_ids"] + list(marker)
    for token in thought:   # free while reasoning: nothing masked
        assert torch.equal(grammars.mask(logits, [grammars.row("r1", spec, [1, 2], 0)]), logits)
        assert grammars.accept([grammars.row("r1", spec, [1, 2], 0)], [token]) == [False]
    masked = grammars.mask(logits, [grammars.row("r1", spec, [1, 2], 0)])
    allowed = {tokenizer.decode([t]) for t in torch.nonzero(masked[0] > -1e30).flatten().tolist()}
    assert allowed and all("Yes".startswith(a) or "No".startswith(a) for a in allowed)
    # A hand-off (decode starting from prefill's tokens) replays only what follows the marker.
    yes = tokenizer("Y", add_special_tokens=False)["input_ids"]
    other = GrammarSampler(grammars.compilers)
    handed = other.row("r2", spec, [1, 2], 0, thought + yes)
    other.prepare(handed)
    after = other.mask(logits, [other.row("r2", spec, [1, 2], 0)])
    assert {tokenizer.decode([t]) for t in torch.nonzero(after[0] > -1e30).flatten().tolist()} <= {"e", "es"}
    grammars.release("r1")
    assert "r1" not in grammars
