"""vLLM's output knobs (gateway/output_options.py) on chat and completions, through the official
``openai`` client against a real ``omni-serve`` of the tiny model: include_stop_str_in_output,
skip_special_tokens, spaces_between_special_tokens, truncate_prompt_tokens and
return_tokens_as_token_ids, each served as vLLM 0.32 answers it."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from omnirelay.gateway.detokenizer import IncrementalDetokenizer
from omnirelay.gateway.schema import NOT_SERVED

MODEL = "tiny-llm"
PROMPT = "The weather today is"
EOS_ID = 2   # tiny-llm's generation_config: eos_token_id [2, 0]
KNOBS = ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
         "truncate_prompt_tokens", "return_tokens_as_token_ids")


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def complete(client, stream: bool = False, **extra) -> tuple[str, list[int], str]:
    """Greedy completion: (text, token ids, finish_reason), streamed or not."""
    kwargs = dict(model=MODEL, prompt=extra.pop("prompt", PROMPT), max_tokens=extra.pop("max_tokens", 16),
                  temperature=0, extra_body={"return_token_ids": True, **extra})
    if not stream:
        choice = client.completions.create(**kwargs).choices[0]
        return choice.text, choice.token_ids, choice.finish_reason
    text, ids, finish = "", [], None
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            ids += getattr(choice, "token_ids", None) or []
            finish = choice.finish_reason or finish
    return text, ids, finish


def test_the_knobs_are_served_not_refused():
    assert not set(KNOBS) & set(NOT_SERVED)


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(client, stream):
    plain, _, _ = complete(client)
    stop = plain[len(plain) // 3:len(plain) // 3 + 2]
    cut, _, finish = complete(client, stream, stop=[stop])
    kept, _, finish_kept = complete(client, stream, stop=[stop], include_stop_str_in_output=True)
    assert finish == finish_kept == "stop" and stop not in cut
    assert kept == cut + stop and plain.startswith(kept)


@pytest.mark.parametrize("stream", [False, True])
def test_the_stop_token_is_text_only_with_include_stop_str_and_special_tokens_kept(client, tokenizer, stream):
    eos = {"logit_bias": {str(EOS_ID): 100}}
    eos_text = tokenizer.decode([EOS_ID], skip_special_tokens=False)
    assert eos_text   # a special token with a spelling
    for options, expected in (({}, ""), ({"skip_special_tokens": False}, ""),
                              ({"skip_special_tokens": False, "include_stop_str_in_output": True}, eos_text),
                              ({"include_stop_str_in_output": True}, "")):
        text, ids, finish = complete(client, stream, **eos, **options)
        assert (text, ids, finish) == (expected, [EOS_ID], "stop"), options
    # A stop token id that is an ordinary word: counted, not text (vLLM), unless included.
    plain, ids, _ = complete(client)
    stop_id = ids[2]
    text, got, _ = complete(client, stream, stop_token_ids=[stop_id])
    assert got == ids[:3] and text == tokenizer.decode(ids[:2])
    text, _, _ = complete(client, stream, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert text == tokenizer.decode(ids[:3])


def special_ids(tokenizer) -> list[int]:
    return [i for i, t in tokenizer.added_tokens_decoder.items() if t.special and i != EOS_ID and i != 0]


def test_skip_special_tokens_false_writes_them(client, tokenizer):
    special = special_ids(tokenizer)[0]
    forced = {"logit_bias": {str(special): 100}, "max_tokens": 3}
    skipped, ids, _ = complete(client, **forced)
    assert ids == [special] * 3 and skipped == ""
    written, _, _ = complete(client, skip_special_tokens=False, **forced)
    assert written == tokenizer.decode(ids, skip_special_tokens=False) and written
    bare, _, _ = complete(client, skip_special_tokens=False, spaces_between_special_tokens=False, **forced)
    assert bare == tokenizer.added_tokens_decoder[special].content * 3


def test_spaces_between_special_tokens_false_joins_added_tokens_bare(tokenizer):
    special = special_ids(tokenizer)[0]
    word = tokenizer.encode(" hello world")
    ids = word + [special, special] + word
    detok = IncrementalDetokenizer(tokenizer, skip_special=False, spaces_between=False)
    detok.add(ids, final=True)
    content = tokenizer.added_tokens_decoder[special].content
    assert detok.take(final=True) == tokenizer.decode(word) + content * 2 + tokenizer.decode(word)
    # Skipping special tokens makes the switch moot (vLLM's rule).
    detok = IncrementalDetokenizer(tokenizer, skip_special=True, spaces_between=False)
    detok.add(ids, final=True)
    assert detok.take(final=True) == tokenizer.decode(ids, skip_special_tokens=True)


def test_truncate_prompt_tokens_keeps_the_last_k(client, tokenizer):
    prompt = tokenizer.encode("one two three four five six seven eight nine ten eleven twelve")
    assert len(prompt) > 6
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                         extra_body={"truncate_prompt_tokens": 5})
    tail = client.completions.create(model=MODEL, prompt=prompt[-5:], max_tokens=6, temperature=0)
    assert response.usage.prompt_tokens == 5 and response.choices[0].text == tail.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(prompt)
    for bad in (0, -2, 10**9, "5"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"truncate_prompt_tokens": bad})
        assert caught.value.body["param"] == "truncate_prompt_tokens", bad


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    ids = chat.choices[0].token_ids
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{i}" for i in ids]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                                           extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = completion.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{i}" for i in choice.token_ids]
    assert all(key.startswith("token_id:") for top in choice.logprobs.top_logprobs for key in top)
    # The text itself is unchanged.
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert choice.text == plain.choices[0].text


def test_a_bad_knob_is_a_400_naming_it(client):
    for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                 "return_tokens_as_token_ids"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={name: "yes"})
        assert caught.value.body["param"] == name
