"""Request shapes beyond one choice, through the official ``openai`` client against a real ``omni-serve``
(tiny model): ``n`` > 1 (chat and completions, streamed and whole), a list of prompts in one
``/v1/completions``, ``echo``, and vLLM's ``/tokenize`` and ``/detokenize``.

The n choices of a prompt share its prefix: the prefill worker's counters (``/cluster``, from its
heartbeats) show the prompt's full blocks computed once, not n times.
"""

from __future__ import annotations

import json

import openai
import pytest
import requests

from omnirelay.gateway.schema import MAX_CHOICES

from cluster import settled_workers

MODEL = "tiny-llm"
BLOCK = 16   # omni-worker's default --block-size
LONG_PROMPT = "The archive holds records of " + " ".join(f"item{i} filed" for i in range(40))


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


def _settled_worker(server, role: str) -> dict:
    """The one ``role`` worker once every answered request is counted in its stats (they travel in
    heartbeats: :func:`settled_workers` waits for the cluster to say they are final)."""
    workers = [w for w in settled_workers(server.url) if w["role"] == role]
    assert len(workers) == 1, workers
    return workers[0]


def _settled_prefill_stats(server) -> dict:
    return _settled_worker(server, "prefill")["stats"]


def test_n_choices_prefill_the_shared_prompt_once(client, server):
    prompt_tokens = len(requests.post(server.url + "/tokenize", timeout=10, json={
        "model": MODEL, "prompt": LONG_PROMPT, "add_special_tokens": False}).json()["tokens"])
    full_blocks = (prompt_tokens - 1) // BLOCK
    assert full_blocks >= 4, prompt_tokens
    before = _settled_prefill_stats(server)
    n = 4
    reply = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=3, temperature=0.7, seed=11, n=n)
    assert len(reply.choices) == n and reply.usage.prompt_tokens == prompt_tokens
    after = _settled_prefill_stats(server)
    computed = after["prefill_tokens"] - before.get("prefill_tokens", 0)
    reused = after.get("prefix_cached_tokens", 0) - before.get("prefix_cached_tokens", 0)
    # Choice 0 computes the whole prompt (or less, if an earlier test left its blocks cached); each
    # sibling reuses every full block and computes only the tail.
    assert computed <= prompt_tokens + (n - 1) * (prompt_tokens - full_blocks * BLOCK), (computed, before, after)
    assert reused >= (n - 1) * full_blocks * BLOCK, (reused, before, after)
    assert computed + reused == n * prompt_tokens
    print(f"\nn={n} choices of a {prompt_tokens}-token prompt: prefill computed {computed} tokens and reused "
          f"{reused} from its prefix cache (without sharing: {n * prompt_tokens} computed)")


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
        (dict(prompt="x", n=MAX_CHOICES + 1), 400, "n"),
        (dict(prompt=["a", ""]), 400, "prompt[1]"),
        (dict(prompt=["a", [1, -2]]), 400, "prompt[1]"),
        (dict(prompt=[]), 400, "prompt"),
        (dict(prompt=["a"] * (MAX_CHOICES // 2 + 1), n=2), 400, "prompt"),
        (dict(prompt="x", echo=True, logprobs=21), 400, "logprobs"),   # echo with logprobs is served (up to 20)
        (dict(prompt=["a", "word " * 5000], n=2), 400, "prompt[1]"),   # too long for the context: nothing runs
    ]
    for kwargs, status, param in cases:
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=MODEL, max_tokens=2, **kwargs)
        assert info.value.status_code == status, kwargs
        assert info.value.body["param"] == param, (kwargs, info.value.body)
    with pytest.raises(openai.APIStatusError) as info:
        _chat(client, "hi", n=2, modalities=["text", "audio"], audio={"voice": "a", "format": "wav"})
    assert (info.value.status_code, info.value.body["param"]) == (422, "n")
    with pytest.raises(openai.APIStatusError) as info:
        _chat(client, "hi", max_tokens=2, extra_body={"echo": True})   # vLLM's chat echo: not served
    assert (info.value.status_code, info.value.body["param"]) == (422, "echo")


def test_a_client_leaving_cancels_every_choice_upstream(server):
    cancelled_before = _settled_worker(server, "decode")["stats"].get("cancelled", 0)   # earlier tests' all in
    body = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0.5, "n": 3, "stream": True}
    chunks = [0, 0, 0]
    with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                chunks[json.loads(line[6:])["choices"][0]["index"]] += 1
            # A choice's first chunk is prefill's token, sent while its hand-off to decode may still be in
            # flight; from the third on, decode is running it.
            if min(chunks) >= 3:
                break   # every choice is decoding: hang up
    decode = _settled_worker(server, "decode")   # settled: the cancels reached decode and a heartbeat says so
    cancelled = decode["stats"].get("cancelled", 0) - cancelled_before
    assert cancelled == 3 and decode["running"] == 0, decode   # stopped by the hang-up, not by 400 tokens


# ------------------------------------------------------------------------------------ /tokenize, /detokenize


def test_tokenize_and_detokenize_round_trip_equals_the_tokenizer(server, tiny_model, client):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = "Hello there, how are you today? Ünïcödé too."
    answer = requests.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=10).json()
    assert answer["tokens"] == tokenizer(text)["input_ids"] and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == client.models.list().data[0].model_extra["max_model_len"]
    assert answer["token_strs"] is None
    plain = requests.post(server.url + "/tokenize", timeout=10, json={
        "prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()   # model: the only one
    assert plain["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert plain["token_strs"] == tokenizer.convert_ids_to_tokens(plain["tokens"])
    back = requests.post(server.url + "/detokenize", json={"model": MODEL, "tokens": plain["tokens"]}, timeout=10)
    assert back.json() == {"prompt": tokenizer.decode(plain["tokens"])} and back.json()["prompt"] == text
    # A chat body is templated as /v1/chat/completions templates it: its count is that request's usage.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    chat = requests.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=10).json()
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert chat["count"] == reply.usage.prompt_tokens
    assert chat["tokens"] == tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                     tokenize=False),
                                       add_special_tokens=False)["input_ids"]
    bare = requests.post(server.url + "/tokenize", timeout=10, json={
        "model": MODEL, "messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"] and chat["tokens"][:bare["count"]] == bare["tokens"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "x", "messages": []}, 400, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": 3}, 400, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "", "content": "x"}]}, 400, "messages[0].role"),   # a custom role is passed on; an empty one is not a role
    ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
                   "add_generation_prompt": True}, 400, "continue_final_message"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"},
     422, "chat_template"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}, 422, "messages[0].content"),
    ("/detokenize", {"model": MODEL}, 400, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
])
def test_bad_tokenizer_requests_name_their_param(server, path, body, status, param):
    response = requests.post(server.url + path, json=body, timeout=10)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_openapi_documents_choices_and_the_tokenizer_routes(server):
    doc = requests.get(server.url + "/openapi.json", timeout=10).json()
    assert {"/tokenize", "/detokenize"} <= set(doc["paths"])
    schema = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema["properties"]["n"]["maximum"] == MAX_CHOICES
    assert schema["properties"]["echo"]["type"] == "boolean" and "enum" not in schema["properties"]["echo"]
    assert len(schema["properties"]["prompt"]["oneOf"]) == 3   # text, token ids, a list of either
    tokenize = doc["paths"]["/tokenize"]["post"]
    assert {"400", "404", "422"} <= set(tokenize["responses"])


# ------------------------------------------------------------------------------------ two prefill workers


@pytest.fixture
def two_prefill_cluster(tiny_model, tmp_path):
    from cluster import prefill_pair_cluster
    with prefill_pair_cluster(tiny_model, str(tmp_path), model_name=MODEL) as cluster:
        yield cluster


@pytest.mark.slow
def test_the_choices_of_a_prompt_land_on_the_prefill_worker_that_holds_it(two_prefill_cluster):
    """Two prefill workers: the n choices of one prompt all go to the worker that prefilled the first
    (the broker routes the siblings for their cached prefix), which reuses the prompt's blocks."""
    cluster = two_prefill_cluster
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    n = 3
    reply = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0.7, seed=5, n=n)
    assert len(reply.choices) == n
    # The engines' counters travel in heartbeats: read once the cluster says they are final.
    prefill = sorted((w for w in settled_workers(cluster.url) if w["role"] == "prefill"),
                     key=lambda w: w["dispatched"], reverse=True)
    hits = [w["stats"].get("prefix_hit_requests", 0) for w in prefill]
    assert [w["dispatched"] for w in prefill] == [n, 0], prefill
    assert [w["prefix_routed"] for w in prefill] == [n - 1, 0], prefill
    assert hits == [n - 1, 0], prefill
    assert prefill[0]["stats"]["prefix_cached_tokens"] >= (n - 1) * 4 * BLOCK, prefill


@pytest.fixture
def failing_store(tiny_model, tmp_path):
    """Decode cannot fetch any KV: every choice fails once the broker's restarts are spent."""
    from cluster import Cluster
    pipeline = tmp_path / "failing.yaml"
    pipeline.write_text(json.dumps({   # YAML is a superset of JSON
        "stages": [{"name": "prefill", "role": "prefill"}, {"name": "decode", "role": "decode"}],
        "connectors": {"kv": {"type": "fault_injection", "options": {"inner": "shared_memory",
                                                                      "fail_every_nth_get": 1}}},
        "edges": [{"from": "prefill", "to": "decode", "connector": "kv"}]}))
    with Cluster(model=tiny_model, model_name=MODEL, log_dir=str(tmp_path)) as cluster:
        cluster.start_broker()
        cluster.start_worker("prefill", "--stage-configs-path", str(pipeline))
        cluster.start_worker("decode", "--stage-configs-path", str(pipeline))
        cluster.start_gateway()
        cluster.wait_healthy()
        yield cluster


@pytest.mark.slow
def test_a_failing_choice_fails_the_request_with_the_error_contract(failing_store):
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0.5, "n": 2}
    whole = requests.post(failing_store.url + "/v1/completions", json=body, timeout=60)
    assert whole.status_code == 502, whole.text
    error = whole.json()
    assert error["error"]["code"] == "transfer_failed" and error["request_id"].startswith("cmpl-")
    assert error["stage"] == "decode" and int(whole.headers["Retry-After"]) >= 1
    # Streamed: the first token (from prefill) opens the stream; the failure is its last event.
    with requests.post(failing_store.url + "/v1/completions", json={**body, "stream": True}, stream=True,
                       timeout=60) as streamed:
        events = [line[6:] for line in streamed.iter_lines() if line.startswith(b"data: ")]
    if streamed.status_code == 200:
        assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1, events
        last = json.loads(events[-2])
        assert last["error"]["code"] == "transfer_failed" and last["request_id"].startswith("cmpl-"), events
    else:   # failed before its first token
        assert streamed.status_code == 502
    workers = settled_workers(failing_store.url)   # nothing left anywhere: the sibling was cancelled too
    assert all(w["running"] == 0 for w in workers), workers


@pytest.fixture
def keyed_gateway(tiny_model, tmp_path):
    """A broker and a gateway with an API key, no worker: the tokenizer routes need none."""
    from cluster import Cluster
    with Cluster(model=tiny_model, model_name=MODEL, log_dir=str(tmp_path)) as cluster:
        cluster.start_broker()
        cluster.start_gateway("--api-key", "s3cret")
        yield cluster


def test_the_tokenizer_routes_need_the_api_key_and_no_worker(keyed_gateway):
    for path, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [1, 2]})):
        refused = requests.post(keyed_gateway.url + path, json=body, timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized", refused.text
        served = requests.post(keyed_gateway.url + path, json=body, timeout=10,
                               headers={"Authorization": "Bearer s3cret"})
        assert served.status_code == 200, served.text
