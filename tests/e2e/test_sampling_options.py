"""Request options that change the answer: each is either served or refused (422 naming it), never
a 200 that ignored it. The served sampling options (penalties, logit_bias, min_p, min_tokens,
bad_words, allowed_token_ids) are checked twice: the worker's vectorised logits processors against
a per-row reference, and end to end through the official ``openai`` client against a real
``omni-serve`` (and a cluster whose decode worker is killed mid-stream).
"""

from __future__ import annotations

import openai
import pytest
import requests

from omnirelay.errors import Unprocessable
from omnirelay.gateway.schema import NOT_SERVED, parse_chat, parse_completion

MODEL = "tiny-llm"

# One value per option that would change the answer (an option missing here fails the test below).
_ANSWER_CHANGING = {
    "presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3, "logit_bias": {"5": 100},
    "min_p": 0.1, "min_tokens": 4, "bad_words": ["the"], "allowed_token_ids": [1, 2, 3], "best_of": 2,
    "use_beam_search": True, "length_penalty": 0.5, "logits_processors": ["x"],
    "response_format": {"type": "json_object"}, "structured_outputs": {"json": {"type": "object"}},
    "guided_json": {"type": "object"}, "guided_regex": "[a-z]+", "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= \"a\"", "guided_decoding_backend": "xgrammar",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "required", "parallel_tool_calls": False,
    "functions": [{"name": "f", "parameters": {"type": "object"}}], "function_call": "auto",
    "prompt_logprobs": 1, "include_stop_str_in_output": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 8, "suffix": "end",
    "add_generation_prompt": False, "continue_final_message": True, "add_special_tokens": True,
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"enable_thinking": True},
    "return_tokens_as_token_ids": True, "reasoning_effort": "high", "web_search_options": {},
    "prompt_embeds": "AAAAAA==",   # base64 of a tensor, as vLLM takes it
}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize("name", sorted(NOT_SERVED))
def test_an_option_not_served_is_a_422_naming_it(name):
    value = _ANSWER_CHANGING[name]
    for parse, body in ((parse_chat, _chat(**{name: value})),
                        (parse_completion, {"model": MODEL, "prompt": "hi", name: value})):
        with pytest.raises(Unprocessable) as caught:
            parse(body)
        assert caught.value.param == name and caught.value.status == 422


@pytest.mark.parametrize("name", sorted(NOT_SERVED))
def test_an_option_at_its_harmless_value_is_accepted(name):
    for value in (None, *NOT_SERVED[name]):
        parse_chat(_chat(**{name: value}))


def test_a_harmless_value_must_match_in_type_too():
    if "use_beam_search" in NOT_SERVED:
        with pytest.raises(Unprocessable):
            parse_chat(_chat(use_beam_search=0))


def test_hints_are_ignored():
    parse_chat(_chat(user="u", metadata={"k": "v"}, store=False, service_tier="auto",
                     prediction={"type": "content", "content": "x"}))


def test_not_served_through_the_openai_client(client):
    """Every option of the table, as a client sends it (``extra_body`` for vLLM's), gets a 422
    naming it, chat and completions alike."""
    for name in sorted(NOT_SERVED):
        value = _ANSWER_CHANGING[name]
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_body={name: value})
        assert caught.value.body["param"] == name, caught.value.body
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={name: value})
        assert caught.value.body["param"] == name, caught.value.body


# ---------------------------------------------------------------------------------------------
# The worker's logits processors: vectorised == a straightforward per-row reference.

import random  # noqa: E402

import torch  # noqa: E402

import msgspec  # noqa: E402

from omnirelay.broker import protocol as p  # noqa: E402
from omnirelay.errors import BadRequest  # noqa: E402
from omnirelay.request_params import StructuredOutput, TextParams  # noqa: E402
from omnirelay.speech_params import SpeechParams  # noqa: E402
from omnirelay.workers.llm.logits_processors import LogitsProcessors, TokenHistory  # noqa: E402
from omnirelay.workers.llm.sampling import sample  # noqa: E402

VOCAB = 50
EOS = (2, 7)


def _reference(logits: torch.Tensor, params: TextParams, history: TokenHistory) -> torch.Tensor:
    """vLLM's semantics, one row, one token at a time."""
    raw = logits.float()
    row = raw.clone()
    output = history.context[len(history.context) - history.resumed:] + history.generated
    prompt = history.context[:len(history.context) - history.resumed]
    if params.allowed_token_ids:
        for t in range(VOCAB):
            if t not in params.allowed_token_ids:
                row[t] = float("-inf")
    for word in params.bad_words_token_ids:
        prefix = list(word[:-1])
        if not prefix or output[len(output) - len(prefix):] == prefix and len(output) >= len(prefix):
            row[word[-1]] = float("-inf")
    if len(history.generated) < params.min_tokens:
        for t in (() if params.ignore_eos else EOS) + params.stop_token_ids:
            row[t] = float("-inf")
    for t, b in params.logit_bias:
        row[t] += b
    for t in set(prompt) | set(output):
        row[t] = row[t] / params.repetition_penalty if row[t] > 0 else row[t] * params.repetition_penalty
    for t in set(output):
        row[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    if params.min_p > 0 and not params.greedy:
        probs = torch.softmax(row / params.temperature, dim=-1)
        row[probs < probs.max() * params.min_p] = float("-inf")
    if torch.isneginf(row).all():
        return raw
    return row


def _random_params(rng: random.Random) -> TextParams:
    pick = lambda p: rng.random() < p  # noqa: E731
    return TextParams(
        temperature=rng.choice([0.0, 0.7, 1.3]), ignore_eos=pick(0.3),
        stop_token_ids=tuple(rng.sample(range(VOCAB), 2)) if pick(0.5) else (),
        presence_penalty=rng.uniform(-2, 2) if pick(0.4) else 0.0,
        frequency_penalty=rng.uniform(-2, 2) if pick(0.4) else 0.0,
        repetition_penalty=rng.uniform(0.5, 2) if pick(0.4) else 1.0,
        logit_bias=tuple((t, rng.uniform(-100, 100)) for t in rng.sample(range(VOCAB), 3)) if pick(0.3) else (),
        min_p=rng.uniform(0, 0.5) if pick(0.3) else 0.0, min_tokens=rng.choice([0, 0, 2, 5]),
        bad_words_token_ids=tuple(tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 3)))
                                  for _ in range(rng.randint(1, 4))) if pick(0.4) else (),
        allowed_token_ids=tuple(rng.sample(range(VOCAB), rng.randint(1, 10))) if pick(0.2) else ())


def _random_history(rng: random.Random) -> TokenHistory:
    # Small alphabets make repeats and bad-word matches likely.
    context = [rng.randrange(12) for _ in range(rng.randint(1, 12))]
    return TokenHistory(context, rng.randint(0, len(context) - 1), [rng.randrange(12) for _ in range(rng.randint(0, 8))])


@pytest.mark.parametrize("seed", range(20))
def test_processors_match_the_reference(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    batch = rng.randint(1, 12)
    logits = torch.randn(batch, VOCAB) * 3
    params = [_random_params(rng) for _ in range(batch)]
    histories = [_random_history(rng) for _ in range(batch)]
    before = logits.clone()
    out = LogitsProcessors(EOS).apply(logits, params, histories)
    assert torch.equal(logits, before), "the raw logits are never written"
    expected = torch.stack([_reference(logits[i], params[i], histories[i]) for i in range(batch)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


def test_no_options_is_the_input_itself():
    logits = torch.randn(4, VOCAB)
    params = [TextParams(temperature=t) for t in (0.0, 1.0, 0.5, 0.0)]
    assert LogitsProcessors(EOS).apply(logits, params, [TokenHistory([1])] * 4) is logits


def test_greedy_rows_obey_the_options():
    logits = torch.ones(3, VOCAB)
    logits[:, 9] = 5.0
    greedy = dict(temperature=0.0)
    params = [TextParams(logit_bias=((4, 100.0),), **greedy), TextParams(allowed_token_ids=(11, 12), **greedy),
              TextParams(repetition_penalty=10.0, **greedy)]
    histories = [TokenHistory([1]), TokenHistory([1]), TokenHistory([1, 9])]
    scores = LogitsProcessors(EOS).apply(logits, params, histories)
    tokens = sample(scores, params, [0, 0, 0])
    assert tokens[0] == 4 and tokens[1] in (11, 12) and tokens[2] != 9


def test_a_resumed_history_counts_its_resumed_tokens_as_output():
    """Frequency/presence see output only: the same ids in the prompt part do not count; after a
    resume the replayed tail of the context does."""
    logits = torch.zeros(2, VOCAB)
    params = [TextParams(frequency_penalty=1.0)] * 2
    fresh = TokenHistory([5, 5, 6], resumed=0, generated=[6])
    resumed = TokenHistory([5, 5, 6], resumed=2, generated=[6])   # output: 5, 6, 6
    out = LogitsProcessors(EOS).apply(logits, params, [fresh, resumed])
    assert out[0, 5] == 0 and out[0, 6] == -1
    assert out[1, 5] == -1 and out[1, 6] == -2


def test_a_tiny_repetition_penalty_leaves_finite_scores_a_sampler_can_draw_from():
    """Found by schemathesis: repetition_penalty 5e-324 turned seen positive logits into +inf and
    the sampler's softmax into NaN, which killed the worker."""
    logits = torch.randn(2, VOCAB).abs() + 1
    logits[1, 3] = float("-inf")   # masked upstream (a grammar): stays masked
    params = [TextParams(repetition_penalty=5e-324, temperature=t) for t in (1.0, 0.0)]
    histories = [TokenHistory([1, 2, 3, 4]), TokenHistory([1, 2, 3, 4])]
    scores = LogitsProcessors(EOS).apply(logits, params, histories)
    assert not torch.isposinf(scores).any() and not torch.isnan(scores).any() and scores[1, 3] == float("-inf")
    tokens = sample(scores, params, [0, 0])
    assert tokens[0] in (1, 2, 3, 4) and tokens[1] in (1, 2, 4)


def test_a_temperature_below_vllms_epsilon_is_greedy():
    logits = torch.randn(1, VOCAB) * 5
    assert sample(logits, [TextParams(temperature=1e-300)], [0]) == [int(logits.argmax())]


def test_a_row_left_without_tokens_keeps_its_input():
    logits = torch.randn(1, VOCAB)
    params = [TextParams(allowed_token_ids=(EOS[0],), min_tokens=3)]
    assert torch.equal(LogitsProcessors(EOS).apply(logits, params, [TokenHistory([1])]), logits)


@pytest.mark.parametrize("raw, error", [
    ({"presence_penalty": 3}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": [[1, 200]]}, "logit_bias"), ({"logit_bias": [[-1, 2]]}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"), ({"bad_words_token_ids": [[]]}, "bad_words"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids"), ({"min_p": "0.1"}, "min_p"),
    ({"frequency_penallty": 1.0}, "unknown fields"), ({"audio_stream": True}, "unknown fields"),
])
def test_the_bus_refuses_text_params_no_worker_could_serve(raw, error):
    """A Submit whose params fail a range check or name a field nobody reads is a malformed message
    at the broker (and a Task one at the worker): the checks run in the bus decoder."""
    body = msgspec.msgpack.encode({"request_id": "r", "model": "m", "stages": ["prefill"], "prompt_token_ids": [1],
                                   "params": {"type": "text", **raw}, "deadline": 1.0, "reply_to": ""})
    with pytest.raises(p.ProtocolError, match=error):
        p.decode([p.VERSION_FRAME, p.Submit.TAG, body])


def test_text_params_travel_whole_and_check_the_vocabulary():
    params = TextParams(presence_penalty=0.5, logit_bias=((3, -1.0),), bad_words_token_ids=((1, 2),),
                        allowed_token_ids=(3, 4), min_tokens=2, min_p=0.1, lora="a1",
                        structured=StructuredOutput("regex", "a+"), speech=SpeechParams("Ethan", stream=True))
    submit = p.Submit("r", "m", ["prefill"], [1], params, 1.0, "")
    assert p.decode(p.encode(submit)).params == params
    params.check_vocab(5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        params.check_vocab(4)
    with pytest.raises(BadRequest, match="top_p") as refused:   # built by the gateway: a 400 naming it
        TextParams(top_p=0)
    assert refused.value.param == "top_p"


# ---------------------------------------------------------------------------------------------
# End to end: each option changes the answer the way it should.

PROMPT = "The weather today is"
EOS_ID = 2   # tiny-llm's generation_config: eos_token_id [2, 0]


def _complete(client, max_tokens: int = 24, **options) -> tuple[list[int], str, str]:
    """Greedy completion: (token ids, text, finish_reason)."""
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                         extra_body={"return_token_ids": True, **options})
    choice = response.choices[0]
    assert response.usage.completion_tokens == len(choice.token_ids)
    return choice.token_ids, choice.text, choice.finish_reason


def _first_repeat(tokens: list[int]) -> int:
    return next(i for i, t in enumerate(tokens) if t in tokens[:i])


def test_a_penalty_breaks_a_greedy_repetition(client):
    plain, _, _ = _complete(client)
    repeat = _first_repeat(plain)   # the greedy answer of this random model repeats itself
    for options in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        penalised, _, _ = _complete(client, **options)
        assert penalised[:repeat] == plain[:repeat], options          # nothing to penalise before
        assert penalised[repeat] not in penalised[:repeat], options    # the repeat is gone
    # repetition_penalty counts the prompt too: the answer changes, and the repeat is not taken.
    penalised, _, _ = _complete(client, repetition_penalty=2.0)
    assert penalised != plain and plain[repeat] not in penalised[repeat:repeat + 1]


def test_logit_bias_forces_and_bans_tokens(client):
    plain, _, _ = _complete(client, max_tokens=8)
    forced, _, _ = _complete(client, max_tokens=8, logit_bias={"42": 100})
    assert forced == [42] * 8
    banned, _, _ = _complete(client, max_tokens=8, logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logit_bias={"42": 100})
    assert chat.choices[0].message.content == "HHHH"   # token 42 is "H"


def test_min_tokens_outlasts_eos_a_stop_token_and_a_stop_string(client):
    eos = {"logit_bias": {str(EOS_ID): 100}}
    tokens, _, finish = _complete(client, **eos)
    assert (tokens, finish) == ([EOS_ID], "stop")
    tokens, _, finish = _complete(client, min_tokens=5, **eos)
    assert finish == "stop" and len(tokens) == 6 and tokens[-1] == EOS_ID and EOS_ID not in tokens[:5]

    plain, text, _ = _complete(client)
    stop_token = plain[2]
    tokens, _, finish = _complete(client, stop_token_ids=[stop_token])
    assert (len(tokens), finish) == (3, "stop")
    tokens, _, finish = _complete(client, stop_token_ids=[stop_token], min_tokens=10)
    assert len(tokens) > 10 and stop_token not in tokens[:10]

    stop = text[len(text) // 4:len(text) // 4 + 2]     # a stop string the plain answer reaches early
    early = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    late = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                     extra_body={"min_tokens": 20})
    assert early.usage.completion_tokens < 20 <= late.usage.completion_tokens
    assert late.choices[0].text.startswith(early.choices[0].text + stop)


def test_allowed_token_ids_bad_words_and_min_p(client):
    allowed = [40, 41, 42]
    tokens, _, _ = _complete(client, allowed_token_ids=allowed)
    assert set(tokens) <= set(allowed)

    plain, text, _ = _complete(client)
    banned_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0).choices[0].text
    tokens, _, _ = _complete(client, bad_words=[banned_text])
    assert tokens[0] != plain[0]

    # min_p = 1 keeps only the most likely token: sampling at any temperature is then greedy.
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.5, seed=7,
                                        extra_body={"return_token_ids": True, "min_p": 1.0})
    assert sampled.choices[0].token_ids == plain


def test_stream_equals_non_stream_with_options(client):
    options = {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_tokens": 6,
               "logit_bias": {"42": 3.5}, "bad_words": ["the"], "return_token_ids": True}
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=options)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=options))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] \
        == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    chat = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=16, temperature=0,
                presence_penalty=1.0, frequency_penalty=0.5, extra_body={"repetition_penalty": 1.2, "min_p": 0.2})
    full = client.chat.completions.create(**chat)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**chat, stream=True)
                       if c.choices)
    assert streamed == full.choices[0].message.content


@pytest.mark.parametrize("options, param", [
    ({"logit_bias": {"99999": 5}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 30, "max_tokens": 10}, "min_tokens"),
    ({"bad_words": "the"}, "bad_words"), ({"bad_words": [""]}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [5, 99999]}, "allowed_token_ids"),
])
def test_bad_options_are_400s_naming_the_param(client, server, options, param):
    before = _submitted(server)
    body = {"max_tokens": 4, **options}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body=body)
    assert caught.value.body["param"] == param, caught.value.body
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body=body)
    assert caught.value.body["param"] == param, caught.value.body
    assert _submitted(server) == before, "a bad request reached the broker"


def _submitted(server) -> int:
    """Requests the broker admitted so far (its counters, through the gateway's /cluster)."""
    return requests.get(server.url + "/cluster", timeout=10).json()["broker"].get("requests_admitted", 0)


# ---------------------------------------------------------------------------------------------
# A decode resumed on another worker keeps the options.

RESUME_OPTIONS = {"frequency_penalty": 0.8, "presence_penalty": 0.4, "repetition_penalty": 1.3, "min_tokens": 40,
                  "bad_words": ["the", "and"], "logit_bias": {"42": 2.0}}
RESUME_MAX_TOKENS = 600


@pytest.fixture
def two_decoders(tiny_model, tmp_path):
    from cluster import Cluster
    with Cluster(model=tiny_model, log_dir=str(tmp_path)) as cluster:
        cluster.start_broker()
        cluster.start_worker("prefill")
        cluster.start_worker("decode")
        cluster.start_worker("decode")
        cluster.start_gateway()
        cluster.wait_healthy()
        cluster.wait_for_workers(3)
        yield cluster


@pytest.mark.slow
def test_a_resumed_decode_keeps_its_penalties(two_decoders):
    """The same greedy request with penalties, whole on an intact cluster, then streamed while the
    decode worker running it is killed: the survivor continues from prompt + tokens sent and, the
    options binding over the resumed output as over its own, the tokens are the same."""
    cluster = two_decoders
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=RESUME_MAX_TOKENS, temperature=0,
                   extra_body={**RESUME_OPTIONS, "ignore_eos": True})
    reference = client.completions.create(**request).choices[0].text
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=RESUME_MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    assert reference != plain   # the options shape this answer

    streamed, killed = [], None
    for chunk in client.completions.create(**request, stream=True):
        streamed += [chunk.choices[0].text] if chunk.choices else []
        if killed is None and len(streamed) >= 8:
            busy = [w for w in cluster.workers() if w["role"] == "decode" and w["assigned"] > 0]
            assert len(busy) == 1, busy
            killed = next(proc for proc in cluster.procs if proc.pid == busy[0]["pid"])
            killed.kill9()
    assert killed is not None and not killed.alive()
    assert "resuming at position" in cluster.logs()
    assert "".join(streamed) == reference
