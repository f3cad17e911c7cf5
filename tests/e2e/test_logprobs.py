"""Logprobs of the chosen tokens, end to end through the official ``openai`` client against a real
``omni-serve`` (prefill samples the first token, decode the rest; both report logprobs), checked
against transformers' ``log_softmax`` of the logits on the same model directory. Plus the pieces
that need no cluster: the sampler's vectorised logprobs on a mixed batch, and the gateway's
reordering keeping each position's logprobs with its token.
"""

from __future__ import annotations

import math

import openai
import pytest
import torch

from omnirelay.broker import protocol as p
from omnirelay.gateway.bus import RequestStream
from omnirelay.request_params import MAX_TOP_LOGPROBS, TextParams
from omnirelay.workers.llm.sampling import chosen_logprobs, sample

MODEL = "tiny-llm"
PROMPT = "Tell me a short story about a cat and a dog."
TOLERANCE = 1e-4   # our kernels sum in another order than transformers'


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model):
    """``hf_logprobs(prompt_ids, generated_ids)``: transformers' log_softmax rows [n, vocab] at the
    positions that produced each generated token (one forward over prompt + generated)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)

    def compute(prompt_ids: list[int], generated_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt_ids + generated_ids])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        rows = logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(generated_ids)]
        return torch.log_softmax(rows, dim=-1)

    return compute


def _chat(client, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 24, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], **kwargs)


def test_greedy_chat_logprobs_equal_transformers(client, hf_logprobs, tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    response = _chat(client, logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True})
    choice = response.choices[0]
    token_ids, prompt_ids = choice.model_extra["token_ids"], response.model_extra["prompt_token_ids"]
    content = choice.logprobs.content
    assert len(content) == len(token_ids) == response.usage.completion_tokens > 1
    reference = hf_logprobs(prompt_ids, token_ids)
    for position, (entry, token_id) in enumerate(zip(content, token_ids)):
        assert abs(entry.logprob - reference[position, token_id].item()) < TOLERANCE, position
        assert entry.token == tokenizer.decode([token_id])
        assert entry.bytes == list(entry.token.encode("utf-8"))
        top = entry.top_logprobs
        assert len(top) == 3
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert top[0].token == entry.token and top[0].logprob == entry.logprob   # greedy: the chosen is the top-1
        ref_values, ref_ids = reference[position].topk(3)
        assert [t.token for t in top] == [tokenizer.decode([i]) for i in ref_ids.tolist()]
        for t, value in zip(top, ref_values.tolist()):
            assert abs(t.logprob - value) < TOLERANCE and t.bytes == list(t.token.encode("utf-8"))
    if not any("\ufffd" in e.token for e in content):   # a split multi-byte character has no text of its own
        assert "".join(e.token for e in content) == choice.message.content


def test_stream_logprobs_equal_non_stream(client):
    full = _chat(client, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    streamed = []
    for chunk in _chat(client, logprobs=True, top_logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [e.token for e in streamed] == [e.token for e in full]
    for a, b in zip(streamed, full):
        assert abs(a.logprob - b.logprob) < 1e-6
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_string_ends_the_logprobs_with_the_token_that_completed_it(client, tiny_model, stream):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    free = _chat(client, logprobs=True, extra_body={"return_token_ids": True}).choices[0]
    ids, text = free.model_extra["token_ids"], free.message.content
    # A stop string that first shows up in the middle of the greedy answer.
    stop = next(text[at: at + 3] for at in range(len(text) // 3, len(text) - 3)
                if text[at: at + 3].strip() and "\ufffd" not in text[at: at + 3] and text.find(text[at: at + 3]) == at)
    needed = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n], skip_special_tokens=True))
    if stream:
        content, entries = "", []
        for chunk in _chat(client, logprobs=True, stop=[stop], stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                content += chunk.choices[0].delta.content or ""
                entries += chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else []
            if chunk.usage:
                completion_tokens = chunk.usage.completion_tokens
    else:
        response = _chat(client, logprobs=True, stop=[stop])
        content, entries = response.choices[0].message.content, response.choices[0].logprobs.content
        completion_tokens = response.usage.completion_tokens
    assert content == text[: text.find(stop)]
    assert len(entries) == completion_tokens == needed
    assert [e.token for e in entries] == [e.token for e in free.logprobs.content[:needed]]
    for a, b in zip(entries, free.logprobs.content):
        assert abs(a.logprob - b.logprob) < TOLERANCE


def test_twenty_top_logprobs(client, hf_logprobs):
    """OpenAI's and vLLM's limit: the 20 most likely tokens of every position, most likely first."""
    response = _chat(client, max_tokens=4, logprobs=True, top_logprobs=20, extra_body={"return_token_ids": True})
    choice = response.choices[0]
    reference = hf_logprobs(response.model_extra["prompt_token_ids"], choice.model_extra["token_ids"])
    for position, entry in enumerate(choice.logprobs.content):
        values = [alt.logprob for alt in entry.top_logprobs]
        expected = reference[position].topk(20).values.tolist()
        assert len(values) == 20 and values == sorted(values, reverse=True)
        assert all(abs(a - b) < TOLERANCE for a, b in zip(values, expected))


def test_chat_without_logprobs_answers_null(client):
    assert _chat(client, max_tokens=4).choices[0].logprobs is None
    assert _chat(client, max_tokens=4, logprobs=True).choices[0].logprobs.content[0].top_logprobs == []


def test_completion_logprobs(client, hf_logprobs):
    response = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=12, temperature=0,
                                         logprobs=2, extra_body={"return_token_ids": True})
    choice = response.choices[0]
    token_ids, prompt_ids = choice.model_extra["token_ids"], choice.model_extra["prompt_token_ids"]
    lp = choice.logprobs
    n = len(token_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n > 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    reference = hf_logprobs(prompt_ids, token_ids)
    for position, token_id in enumerate(token_ids):
        assert abs(lp.token_logprobs[position] - reference[position, token_id].item()) < TOLERANCE
        top = lp.top_logprobs[position]
        assert 1 <= len(top) <= 2 and lp.tokens[position] in top   # greedy: the chosen is among the top
        assert max(top.values()) == pytest.approx(lp.token_logprobs[position])

    streamed = []
    for chunk in client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=12,
                                           temperature=0, logprobs=0, stream=True):
        if chunk.choices[0].logprobs is not None:
            logprobs = chunk.choices[0].logprobs   # logprobs=0: the sampled token's entry alone (vLLM, OpenAI)
            assert logprobs.top_logprobs == [{t: v} for t, v in zip(logprobs.tokens, logprobs.token_logprobs)]
            streamed.append(logprobs)
    assert [t for c in streamed for t in c.tokens] == lp.tokens
    assert [o for c in streamed for o in c.text_offset] == lp.text_offset
    assert all(abs(a - b) < 1e-6 for a, b in zip([v for c in streamed for v in c.token_logprobs], lp.token_logprobs))


def test_sampled_tokens_report_raw_logprobs(client, hf_logprobs):
    """With temperature and top_k the numbers are still those of the raw distribution."""
    response = _chat(client, temperature=1.5, top_p=0.9, seed=5, logprobs=True,
                     extra_body={"return_token_ids": True, "top_k": 20})
    choice = response.choices[0]
    reference = hf_logprobs(response.model_extra["prompt_token_ids"], choice.model_extra["token_ids"])
    for position, (entry, token_id) in enumerate(zip(choice.logprobs.content, choice.model_extra["token_ids"])):
        assert abs(entry.logprob - reference[position, token_id].item()) < TOLERANCE


@pytest.mark.parametrize("extra, param", [({"top_logprobs": 2}, "top_logprobs"),
                                          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                          ({"logprobs": 1}, "logprobs")])
def test_chat_logprobs_parameters_are_checked(client, extra, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body=extra)
    assert raised.value.body["param"] == param


def test_completion_logprobs_out_of_range_is_400(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=21)
    assert raised.value.body["param"] == "logprobs"


# ------------------------------------------------------------------------------- no cluster


def test_sampler_computes_only_the_rows_that_asked():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    params = [TextParams(temperature=0, logprobs=3), TextParams(temperature=0),
              TextParams(temperature=0.7, top_k=5, seed=1, logprobs=0), TextParams(temperature=0, logprobs=5)]
    tokens = sample(logits, params, [0, 0, 0, 0])
    out = chosen_logprobs(logits, params, tokens)
    raw = torch.log_softmax(logits, dim=-1)
    assert out[1] is None
    for row in (0, 2, 3):
        assert math.isclose(out[row].logprob, raw[row, tokens[row]].item(), abs_tol=1e-6)
    assert [i for i, _ in out[0].top] == raw[0].topk(3).indices.tolist() and out[0].top[0][0] == tokens[0]
    assert out[2].top == [] and len(out[3].top) == 5
    with pytest.raises(ValueError, match="logprobs"):
        TextParams(logprobs=MAX_TOP_LOGPROBS + 1)
    with pytest.raises(ValueError, match="logprobs"):
        TextParams(logprobs=True)


def test_request_stream_keeps_logprobs_with_their_positions():
    stream = RequestStream("r", deadline=1e12)

    def delta(start, tokens, finish=""):
        return p.TokenDelta("r", start, tokens, finish, logprobs=[-float(t) for t in tokens],
                            top_token_ids=[[t] for t in tokens], top_logprobs=[[-float(t)] for t in tokens])

    stream.on_delta(delta(1, [11]))          # early: held until position 0 arrives
    stream.on_delta(delta(0, [10]))
    stream.on_delta(delta(0, [10, 11]))      # replayed positions: dropped
    stream.on_delta(delta(2, [12], "stop"))
    events = [stream._queue.get_nowait() for _ in range(2)]
    assert [e.tokens for e in events] == [[10, 11], [12]]
    assert [[lp.logprob for lp in e.logprobs] for e in events] == [[-10.0, -11.0], [-12.0]]
    assert events[0].logprobs[1].top == [(11, -11.0)]
    plain = RequestStream("r", deadline=1e12)
    plain.on_delta(p.TokenDelta("r", 0, [5]))
    assert plain._queue.get_nowait().logprobs == []


def test_tensor_parallel_workers_report_the_same_logprobs(tiny_model, tmp_path, hf_logprobs):
    """TP=2 prefill and decode: rank 0 samples from the gathered logits and reports the logprobs."""
    from conftest import ServeProcess

    serve = ServeProcess(tiny_model, "--served-model-name", MODEL, "--tensor-parallel-size", "2",
                         log_path=str(tmp_path / "serve.log"))
    try:
        tp_client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        response = _chat(tp_client, max_tokens=8, logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
        choice = response.choices[0]
        token_ids = choice.model_extra["token_ids"]
        reference = hf_logprobs(response.model_extra["prompt_token_ids"], token_ids)
        assert len(choice.logprobs.content) == len(token_ids)
        for position, (entry, token_id) in enumerate(zip(choice.logprobs.content, token_ids)):
            assert abs(entry.logprob - reference[position, token_id].item()) < TOLERANCE
            assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob
    finally:
        serve.stop()
