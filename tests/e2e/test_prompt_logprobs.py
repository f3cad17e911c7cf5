"""The prompt's own logprobs, computed by prefill (workers/llm/prompt_logprobs.py) and answered as
vLLM does (gateway/prompt_logprobs.py): ``prompt_logprobs`` on chat and completions, and completions'
``echo`` with ``logprobs`` — through the official ``openai`` client against the session's
``omni-serve``, checked against transformers' ``log_softmax`` over the prompt. ``logprob_token_ids``:
the named ids' logprobs instead of the top k. And ``cache_salt``'s block names (a salted prompt sharing
no cached prefix, and a scored prompt taking none, are in test_cached_tokens.py: they read
``cached_tokens``, which needs ``--enable-prompt-tokens-details``)."""

from __future__ import annotations

import time

import msgspec
import openai
import pytest
import torch

from omnirelay.block_hash import block_hashes
from omnirelay.broker.prefix_index import prompt_route_keys
from omnirelay.request_params import TextParams
from omnirelay.workers.llm.sampling import chosen_logprobs
from omnirelay.workers.llm.prefill import PrefillEngine, PrefillTask

from engine_support import (  # noqa: F401
    GREEDY, QUESTIONS, chat_ids, connector, drain_prefill, model, runner_for, tok)

MODEL = "tiny-llm"
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."
TOLERANCE = 1e-4   # our kernels sum in another order than transformers'


@pytest.fixture(scope="module")
def hf(tiny_model):
    """``hf(ids)``: transformers' log_softmax rows [n - 1, vocab] predicting prompt tokens 1 … n-1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    def rows(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)

    rows.tokenizer = tokenizer
    return rows


def _check_entries(entries: list, ids: list[int], reference: torch.Tensor, k: int) -> None:
    """vLLM's prompt_logprobs list against transformers': the prompt token's logprob and rank, and the top k."""
    assert entries[0] is None and len(entries) == len(ids)
    for i, entry in enumerate(entries[1:]):
        row, token = reference[i], ids[i + 1]
        mine = entry[str(token)]
        assert abs(mine["logprob"] - row[token].item()) < TOLERANCE
        assert mine["rank"] == int((row > row[token]).sum()) + 1
        top = row.topk(k)
        for rank, (value, other) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert abs(entry[str(other)]["logprob"] - value) < TOLERANCE
            if other != token:
                assert entry[str(other)]["rank"] == rank
        assert set(entry) <= {str(token), *map(str, top.indices.tolist())}


def test_chunked_batched_prefill_scores_every_prompt_token(model, tok, connector, hf):
    """A 24-token step budget cuts prompts into chunks and packs them with others that ask nothing
    or another k; a prompt already in the prefix cache is computed again to be scored."""
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    engine = PrefillEngine(runner_for(model, block_size=4, kv_cache_bytes=4 << 20), connector, max_model_len=2048,
                           max_batched_tokens=24)
    engine.add(PrefillTask("warm", prompts[4], GREEDY, time.time() + 60))   # cached before it is scored
    drain_prefill(engine)
    asks = [2, -1, 0, 5, 1, -1]
    for i, (ids, k) in enumerate(zip(prompts, asks)):
        engine.add(PrefillTask(f"r{i}", ids, msgspec.structs.replace(GREEDY, prompt_logprobs=k), time.time() + 60))
    results = drain_prefill(engine)
    for i, (ids, k) in enumerate(zip(prompts, asks)):
        lp = results[f"r{i}"].prompt_logprobs
        if k < 0:
            assert lp is None
            continue
        reference = hf(ids)
        expected = reference.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert len(lp.logprobs) == len(ids) - 1 and torch.allclose(torch.tensor(lp.logprobs), expected, atol=TOLERANCE)
        assert lp.ranks == [int((row > row[t]).sum()) + 1 for row, t in zip(reference, ids[1:])]
        assert all(len(top) == k for top in lp.top_ids)
        if k:
            assert torch.allclose(torch.tensor(lp.top_logprobs), reference.topk(k).values, atol=TOLERANCE)


def test_completion_echo_with_logprobs_equals_transformers(client, hf):
    ids = hf.tokenizer(PROMPT)["input_ids"]
    reference = hf(ids)
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp = answer.choices[0].logprobs
    n = len(ids)
    assert answer.choices[0].text.startswith(PROMPT) and len(lp.tokens) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    for i in range(1, n):
        assert abs(lp.token_logprobs[i] - reference[i - 1, ids[i]].item()) < TOLERANCE
        assert len(lp.top_logprobs[i]) <= 3 and lp.tokens[i] in lp.top_logprobs[i]
    assert lp.text_offset == sorted(lp.text_offset)
    # Streamed, the first chunk leads with the same prompt entries; n=2: each choice has them.
    first = next(iter(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                                logprobs=2, stream=True)))
    assert first.choices[0].logprobs.token_logprobs[:n] == lp.token_logprobs[:n]
    two = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=0, n=2)
    for choice in two.choices:
        assert choice.logprobs.token_logprobs[:n] == lp.token_logprobs[:n]


def test_prompt_logprobs_equal_transformers(client, hf):
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 3})
    ids = hf.tokenizer(PROMPT)["input_ids"]
    _check_entries(answer.choices[0].model_extra["prompt_logprobs"], ids, hf(ids), 3)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
                                          temperature=0, extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    chat_ids = chat.model_extra["prompt_token_ids"]
    _check_entries(chat.model_extra["prompt_logprobs"], chat_ids, hf(chat_ids), 1)


@pytest.mark.parametrize("n", [1, 2])
def test_an_answer_not_asked_for_prompt_logprobs_says_null(client, n):
    """vLLM's answers carry the key, null, when not asked (a completion choice its own, chat at the top)."""
    answer = client.completions.create(model=MODEL, prompt=[PROMPT, "Hi"] if n > 1 else PROMPT, max_tokens=2, n=n,
                                       temperature=0).model_dump()
    assert [choice["prompt_logprobs"] for choice in answer["choices"]] == [None] * (2 * n if n > 1 else 1)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
                                          n=n, temperature=0).model_dump()
    assert "prompt_logprobs" in chat and chat["prompt_logprobs"] is None


@pytest.mark.parametrize("extra, status, param", [
    ({"prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, 422, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ({"cache_salt": ""}, 400, "cache_salt"),
    ({"cache_salt": 7}, 400, "cache_salt")])
def test_bad_values_name_the_param(client, extra, status, param):
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=extra)
    assert caught.value.status_code == status and caught.value.body["param"] == param


def test_block_names_are_salted():
    ids = list(range(64))
    assert block_hashes(ids, 16) == block_hashes(ids, 16, "", "")   # no salt: the names as before
    assert not set(block_hashes(ids, 16, "", "a")) & set(block_hashes(ids, 16))
    assert not set(block_hashes(ids, 16, "", "a")) & set(block_hashes(ids, 16, "", "b"))
    assert not set(block_hashes(ids, 16, "x", "a")) & set(block_hashes(ids, 16, "x"))
    assert prompt_route_keys(ids, 16, salt="a") != prompt_route_keys(ids, 16)


NAMED = [5, 17, 300]


def test_named_ids_replace_the_top_k_in_a_mixed_batch():
    logits = torch.randn(3, 400)
    params = [TextParams(logprobs=2), TextParams(logprobs=0, logprob_token_ids=tuple(NAMED)), TextParams()]
    out = chosen_logprobs(logits, params, [1, 2, 3])
    reference = torch.log_softmax(logits, dim=-1)
    assert [i for i, _ in out[0].top] == reference[0].topk(2).indices.tolist() and out[2] is None
    assert [i for i, _ in out[1].top] == NAMED
    assert torch.allclose(torch.tensor([v for _, v in out[1].top]), reference[1, NAMED], atol=1e-6)
    assert abs(out[1].logprob - reference[1, 2].item()) < 1e-6


def test_logprob_token_ids_through_the_client(client, hf):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=4,
                                          temperature=0, logprobs=True,
                                          extra_body={"logprob_token_ids": NAMED, "return_token_ids": True})
    prompt, generated = chat.model_extra["prompt_token_ids"], chat.choices[0].model_extra["token_ids"]
    rows = hf(prompt + generated)[len(prompt) - 1:]
    for j, entry in enumerate(chat.choices[0].logprobs.content):
        assert [t.token for t in entry.top_logprobs] == [hf.tokenizer.decode([i]) for i in NAMED]
        assert all(abs(t.logprob - rows[j, i].item()) < TOLERANCE for t, i in zip(entry.top_logprobs, NAMED))
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=0,
                                           extra_body={"logprob_token_ids": NAMED})
    for token, top in zip(completion.choices[0].logprobs.tokens, completion.choices[0].logprobs.top_logprobs):
        assert set(top) == {token, *(hf.tokenizer.decode([i]) for i in NAMED)}   # the sampled token's too
    for extra, kwargs in (({"logprob_token_ids": NAMED}, {}), ({"logprob_token_ids": []}, {"logprobs": 1}),
                          ({"logprob_token_ids": [10 ** 6]}, {"logprobs": 1})):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=extra, **kwargs)
        assert caught.value.body["param"] == "logprob_token_ids"
