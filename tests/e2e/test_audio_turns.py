"""OpenAI's multi-turn audio: an assistant turn given back as ``{"audio": {"id": …}}`` (the id of an
earlier spoken answer) reads as that answer's transcript (gateway/spoken_answers.py); an unknown or
expired id is a 400 naming ``messages[i].audio.id``. The store's bounds on their own, then end to end
through the official ``openai`` client on a tiny Qwen2.5-Omni cluster that speaks its answers."""

from __future__ import annotations

import time

import openai
import pytest
import requests

from omnirelay.deploy.builders.omni import build_tiny_omni
from omnirelay.errors import BadRequest
from omnirelay.gateway.schema import chat_messages
from omnirelay.gateway.spoken_answers import SpokenAnswers, resolve_audio_turns

from media_fixtures import client_fixture, pipeline_file
from media_support import pipeline_cluster

MODEL = "tiny-omni"


def test_store_keeps_until_expiry_within_its_bounds():
    answers = SpokenAnswers(max_answers=3, max_chars=10)
    later = time.time() + 3600
    answers.keep("a", "one", later)
    answers.keep("gone", "x", time.time() - 1)   # already expired: never answered
    assert answers.transcript("a") == "one" and answers.transcript("gone") is None
    for name in ("b", "c", "d"):
        answers.keep(name, "two", later)
    assert answers.transcript("a") is None and len(answers) == 3   # the oldest went first
    answers.keep("e", "0123456789", later)   # 10 chars: alone within the character bound
    assert [answers.transcript(n) for n in ("b", "c", "d", "e")] == [None, None, None, "0123456789"]


def test_messages_name_the_bad_audio_turn():
    answers = SpokenAnswers()
    answers.keep("audio_1", "Hello there", time.time() + 60)
    body = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "audio": {"id": "audio_1"}},
                         {"role": "user", "content": "Again"}]}
    resolved = resolve_audio_turns(chat_messages(body), answers)
    assert resolved[1] == {"role": "assistant", "content": "Hello there"}
    body["messages"][1]["audio"]["id"] = "audio_2"
    with pytest.raises(BadRequest) as caught:
        resolve_audio_turns(chat_messages(body), answers)
    assert caught.value.param == "messages[1].audio.id"
    for bad in ({"id": ""}, "audio_1", {"data": "…"}):
        body["messages"][1]["audio"] = bad
        with pytest.raises(BadRequest) as caught:
            chat_messages(body)
        assert caught.value.param == "messages[1].audio"


# -- end to end --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(build_tiny_omni(tmp_path_factory.mktemp("models") / MODEL, seed=0))
    with pipeline_cluster(model, str(tmp_path_factory.mktemp("audio-turn-logs")), MODEL, pipeline_file("omni"),
                          ("encode", "prefill", "decode", "generate"), start_timeout=180) as cluster:
        yield cluster


client = client_fixture(timeout=300)
ASK = {"role": "user", "content": "Say hello to the world"}
AGAIN = {"role": "user", "content": "Say it again"}


def _spoken(client, stream: bool) -> tuple[str, str]:
    """(audio id, transcript) of a spoken answer to ASK."""
    kwargs = dict(model=MODEL, messages=[ASK], modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"},
                  max_tokens=8, temperature=0, extra_body={"max_audio_tokens": 8})
    if not stream:
        audio = client.chat.completions.create(**kwargs).choices[0].message.audio
        return audio.id, audio.transcript
    audio_id, transcript = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        audio = chunk.choices[0].delta.audio if chunk.choices else None   # the client's typed audio delta
        if audio is not None:
            audio_id = audio.id
            transcript += audio.transcript or ""
    return audio_id, transcript


def _prompt_ids(client, turn: dict) -> list[int]:
    answer = client.chat.completions.create(model=MODEL, messages=[ASK, turn, AGAIN], max_tokens=2, temperature=0,
                                            extra_body={"return_token_ids": True})
    return answer.model_extra["prompt_token_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_spoken_turn_given_by_its_id_reads_as_its_transcript(client, cluster, stream):
    audio_id, transcript = _spoken(client, stream)
    assert audio_id.startswith("audio_") and transcript
    by_id = _prompt_ids(client, {"role": "assistant", "audio": {"id": audio_id}})
    assert by_id == _prompt_ids(client, {"role": "assistant", "content": transcript})
    assert by_id != _prompt_ids(client, {"role": "assistant", "content": ""})   # the turn was not dropped
    tokenized = requests.post(cluster.url + "/tokenize", timeout=60, json={
        "model": MODEL, "messages": [ASK, {"role": "assistant", "audio": {"id": audio_id}}, AGAIN]}).json()
    assert tokenized["tokens"] == by_id


@pytest.mark.slow
def test_an_unknown_audio_id_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as caught:
        _prompt_ids(client, {"role": "assistant", "audio": {"id": "audio_never_spoken"}})
    assert caught.value.body["param"] == "messages[1].audio.id"
