"""Request shapes beyond one choice, through the official ``openai`` client against a real ``omni-serve``
(tiny model): ``n`` > 1 (chat and completions, streamed and whole), a list of prompts in one
``/v1/completions``, ``echo``, and vLLM's ``/tokenize`` and ``/detokenize``.

The n choices of a prompt share its prefix: the prefill worker's counters (``/cluster``, from its
heartbeats) show the prompt's full blocks computed once, not n times.
"""

from __future__ import annotations

import time

import openai
import pytest
import requests

MODEL = "tiny-llm"
BLOCK = 16   # omni-worker's default --block-size
LONG_PROMPT = "The archive holds records of " + " ".join(f"item{i} filed" for i in range(40))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, content: str, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def _streamed(chunks) -> tuple[dict[int, str], dict[int, str], list]:
    """Texts and finish reasons by choice index of a completions or chat stream, and the chunks."""
    chunks = list(chunks)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason:
                assert choice.index not in finish, "one finish_reason per choice"
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


# ------------------------------------------------------------------------------------ n > 1


def test_greedy_n3_gives_three_identical_choices(client):
    one = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=10, temperature=0)
    three = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=10, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.text for c in three.choices] == [one.choices[0].text] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens            # the prompt counts once
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens

    chat = _chat(client, "Say something.", max_tokens=8, temperature=0, n=3)
    assert len({c.message.content for c in chat.choices}) == 1 and [c.index for c in chat.choices] == [0, 1, 2]


def test_seeded_n3_is_deterministic_per_choice_and_distinct(client):
    def sample(**kwargs):
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                         seed=1234, extra_body={"return_token_ids": True, "ignore_eos": True},
                                         **kwargs)

    first, again = sample(n=3), sample(n=3)
    ids = [c.model_extra["token_ids"] for c in first.choices]
    assert ids == [c.model_extra["token_ids"] for c in again.choices]
    assert len({tuple(t) for t in ids}) == 3, ids   # each choice draws its own random stream
    # Choice j samples as a single request seeded seed + j (vLLM's children).
    for j in range(3):
        single = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                           seed=1234 + j, extra_body={"return_token_ids": True, "ignore_eos": True})
        assert single.choices[0].model_extra["token_ids"] == ids[j]
    # Streamed: the same choices, chunks of all choices interleaved, each with its index, one [DONE].
    texts, finish, _ = _streamed(sample(n=3, stream=True))
    assert texts == {c.index: c.text for c in first.choices}
    assert finish == {c.index: c.finish_reason for c in first.choices}


def test_chat_n_stream_equals_non_stream(client, server):
    full = _chat(client, "List three colours.", max_tokens=16, temperature=0.8, seed=7, n=2)
    texts, finish, chunks = _streamed(_chat(client, "List three colours.", max_tokens=16, temperature=0.8, seed=7, n=2,
                                            stream=True, stream_options={"include_usage": True}))
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    roles = [(c.index, c.delta.role) for chunk in chunks for c in chunk.choices if c.delta.role]
    assert sorted(roles) == [(0, "assistant"), (1, "assistant")]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    raw = requests.post(server.url + "/v1/chat/completions", timeout=60, stream=True, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2, "stream": True})
    events = [line for line in raw.iter_lines() if line]
    assert events[-1] == b"data: [DONE]" and events.count(b"data: [DONE]") == 1


def test_n_with_logprobs_and_stop(client):
    reply = client.completions.create(model=MODEL, prompt="Count: one two three", max_tokens=8, temperature=0.9,
                                      seed=3, n=2, logprobs=2)
    for choice in reply.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) >= 1
        assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs)
    assert sum(len(c.logprobs.tokens) for c in reply.choices) == reply.usage.completion_tokens
    greedy = client.completions.create(model=MODEL, prompt="Count: one two three", max_tokens=8, temperature=0)
    text = greedy.choices[0].text
    if len(text) >= 3:   # stop on a piece of the greedy answer: every choice stops before it
        stop = text[1:3]
        stopped = client.completions.create(model=MODEL, prompt="Count: one two three", max_tokens=8,
                                            temperature=0, n=2, stop=[stop])
        assert [c.finish_reason for c in stopped.choices] == ["stop", "stop"]
        assert all(c.text == text[:text.index(stop)] for c in stopped.choices)


def _prefill_stats(server) -> dict:
    prefill = [w for w in requests.get(server.url + "/cluster", timeout=10).json()["workers"] if w["role"] == "prefill"]
    assert len(prefill) == 1, prefill
    return prefill[0]["stats"]


def _settled_prefill_stats(server, previous: dict | None = None) -> dict:
    """The prefill worker's counters once its heartbeats have caught up (the same for two in a row,
    and past ``previous`` when given)."""
    deadline = time.monotonic() + 20
    last = _prefill_stats(server)
    while time.monotonic() < deadline:
        time.sleep(1.2)   # a heartbeat is sent every second
        now = _prefill_stats(server)
        moved = previous is None or now.get("prefill_tokens", 0) > previous.get("prefill_tokens", 0)
        if now == last and moved:
            return now
        last = now
    raise AssertionError(f"prefill counters never settled: {last}")


def test_n_choices_prefill_the_shared_prompt_once(client, server):
    prompt_tokens = len(requests.post(server.url + "/tokenize", timeout=10, json={
        "model": MODEL, "prompt": LONG_PROMPT, "add_special_tokens": False}).json()["tokens"])
    full_blocks = (prompt_tokens - 1) // BLOCK
    assert full_blocks >= 4, prompt_tokens
    before = _settled_prefill_stats(server)
    n = 4
    reply = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=3, temperature=0.7, seed=11, n=n)
    assert len(reply.choices) == n and reply.usage.prompt_tokens == prompt_tokens
    after = _settled_prefill_stats(server, before)
    computed = after["prefill_tokens"] - before["prefill_tokens"]
    reused = after.get("prefix_cached_tokens", 0) - before.get("prefix_cached_tokens", 0)
    # Choice 0 computes the whole prompt (or less, if an earlier test left its blocks cached); each
    # sibling reuses every full block and computes only the tail.
    assert computed <= prompt_tokens + (n - 1) * (prompt_tokens - full_blocks * BLOCK), (computed, before, after)
    assert reused >= (n - 1) * full_blocks * BLOCK, (reused, before, after)
    assert computed + reused == n * prompt_tokens


# ------------------------------------------------------------------------------------ prompt lists and echo


def test_a_list_of_prompts_gives_n_choices_per_prompt(client, server):
    prompts = ["The weather today is", "My favourite food is"]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]   # index = prompt_index * n + j
    assert [c.text for c in batch.choices] == [singles[0].choices[0].text] * 2 + [singles[1].choices[0].text] * 2
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
    # Token-id prompts: the same answers as their text.
    token_prompts = [requests.post(server.url + "/tokenize", json={"model": MODEL, "prompt": p,
                                                                   "add_special_tokens": False},
                                   timeout=10).json()["tokens"] for p in prompts]
    by_ids = client.completions.create(model=MODEL, prompt=token_prompts, max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == [s.choices[0].text for s in singles]
    texts, _, _ = _streamed(client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0,
                                                      n=2, stream=True))
    assert texts == {c.index: c.text for c in batch.choices}


def test_echo_puts_the_prompt_first(client):
    plain = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=6, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=6, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "The weather today is" + plain.choices[0].text
    assert echoed.usage == plain.usage
    texts, _, _ = _streamed(client.completions.create(model=MODEL, prompt=["The weather today is", "Hi"],
                                                      max_tokens=6, temperature=0, echo=True, stream=True))
    assert texts[0] == echoed.choices[0].text and texts[1].startswith("Hi")


def test_bad_choice_requests_are_refused_before_any_work(client):
    cases = [
        (dict(prompt="x", n=0), 400, "n"),
        (dict(prompt="x", n=129), 400, "n"),
        (dict(prompt=["a", ""]), 400, "prompt[1]"),
        (dict(prompt=["a", [1, -2]]), 400, "prompt[1]"),
        (dict(prompt=[]), 400, "prompt"),
        (dict(prompt=["a"] * 65, n=2), 400, "prompt"),
        (dict(prompt="x", echo=True, logprobs=1), 422, "echo"),
    ]
    for kwargs, status, param in cases:
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=MODEL, max_tokens=2, **kwargs)
        assert info.value.status_code == status, kwargs
        assert info.value.body["param"] == param, (kwargs, info.value.body)
