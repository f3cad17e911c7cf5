"""``return_token_ids`` as vLLM 0.32 answers it, through the official ``openai`` client against the
session's ``omni-serve``: a completion choice carries its own ``prompt_token_ids`` and ``token_ids``
(echo and logprobs too), chat carries ``prompt_token_ids`` at the top level and ``token_ids`` on its
choice; streamed, the prompt's ids come once on the first chunk and every chunk's ids join up to the
answer's (and, with logprobs, to the ids the logprobs name). Without it, neither key is there."""

from __future__ import annotations

from transformers import AutoTokenizer

MODEL = "tiny-llm"
PROMPT = "Hello, world! How are you today?"


def test_completion_choices_carry_both_id_lists(client, tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True,
                                       logprobs=1, n=2, extra_body={"return_token_ids": True,
                                                                    "return_tokens_as_token_ids": True})
    for choice in answer.choices:
        assert choice.prompt_token_ids == tokenizer(PROMPT)["input_ids"]
        assert 0 < len(choice.token_ids) <= 8
        named = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
        assert named == choice.prompt_token_ids + choice.token_ids   # echo: the prompt's lead
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).model_dump()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_streamed_completion_ids_join_up(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True})
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            logprobs=1, extra_body={"return_token_ids": True,
                                                                    "return_tokens_as_token_ids": True}))
    assert chunks[0].choices[0].prompt_token_ids == whole.choices[0].prompt_token_ids
    assert all(c.choices[0].model_extra.get("prompt_token_ids") is None for c in chunks[1:])
    ids = [t for c in chunks for t in c.choices[0].token_ids]
    named = [int(t.removeprefix("token_id:")) for c in chunks for t in c.choices[0].logprobs.tokens]
    assert ids == named == whole.choices[0].token_ids


def test_chat_carries_the_prompt_ids_at_the_top(client, tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "system", "content": "You like emojis."}, {"role": "user", "content": "I love cats 🐱"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                            logprobs=True, extra_body={"return_token_ids": True})
    prompt = tokenizer.decode(answer.prompt_token_ids)
    assert "You like emojis." in prompt and "I love cats 🐱" in prompt
    assert [t.token for t in answer.choices[0].logprobs.content] == \
        [tokenizer.decode([t]) for t in answer.choices[0].token_ids]
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert stream[0].prompt_token_ids == answer.prompt_token_ids
    assert all("prompt_token_ids" not in c.model_dump() for c in stream[1:])
    assert [t for c in stream for t in (c.choices[0].model_extra.get("token_ids") or [])] == answer.choices[0].token_ids
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0).model_dump()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
