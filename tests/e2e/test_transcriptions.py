"""``/v1/audio/transcriptions`` and ``/v1/audio/translations`` through the official ``openai``
client, on a real ``omni-serve`` of the tiny random-weight Qwen2.5-Omni thinker (encode → prefill →
decode) beside the tiny LLM (which cannot hear). The words are random; what is checked is the flow:
a transcript is the thinker's greedy answer to the audio and the route's instruction (the same chat
request gives the same text), every response format and the stream carry it, FLAC decodes to the
same samples as WAV, and what cannot be served is refused by name. Responses' audio input parts are
checked here too, on the only server that hears."""

from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
import openai
import pytest
import requests
import soundfile

from omnirelay.deploy.builders.omni import build_tiny_omni
from omnirelay.gateway import openapi_text_routes
from omnirelay.gateway.routes.transcriptions import FORMATS, _decoders, _instruction

from conftest import ServeProcess
from media_support import audio_part, image_part, random_png, wav_bytes
from repo_paths import REPO_ROOT

PIPELINES = os.path.join(REPO_ROOT, "deploy", "pipelines")
MAX = 8
EXTRA = {"max_completion_tokens": MAX}


def _tone(freq: float, seconds: float = 1.0) -> np.ndarray:
    pcm = np.round(0.5 * np.sin(np.arange(int(16000 * seconds)) * 2 * np.pi * freq / 16000) * 32767)
    return pcm.astype("<i2")


WAV = wav_bytes(_tone(440.0))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    omni = tmp_path_factory.mktemp("models") / "tiny-omni"
    build_tiny_omni(omni, seed=0)
    log_path = str(tmp_path_factory.mktemp("serve-transcribe") / "omni-serve.log")
    serve = ServeProcess(str(omni), tiny_model, "--served-model-name", "tiny-omni", "--served-model-name", "tiny-llm",
                         "--stage-configs-path", os.path.join(PIPELINES, "omni_thinker.yaml"),
                         "--stage-configs-path", os.path.join(PIPELINES, "llm.yaml"), "--log-level", "WARNING",
                         log_path=log_path)
    yield serve
    serve.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat_text(client, task: str, wav: bytes = WAV, **kwargs) -> str:
    reply = client.chat.completions.create(
        model="tiny-omni", max_tokens=MAX, temperature=0,
        messages=[{"role": "user",
                   "content": [audio_part(wav), {"type": "text", "text": _instruction(task, **kwargs)}]}])
    return reply.choices[0].message.content.strip()


def _transcribe(client, file=("tone.wav", WAV), **kwargs):
    return client.audio.transcriptions.create(model="tiny-omni", file=file, extra_body=EXTRA, **kwargs)


def test_transcript_is_the_thinkers_answer_to_the_audio(client):
    got = _transcribe(client)
    assert got.text == _chat_text(client, "transcribe", language=None, prompt=None)
    assert got.usage.type == "duration" and got.usage.seconds == 1
    # language and prompt go into the instruction: the same chat with them gives the same text.
    hinted = _transcribe(client, language="en", prompt="Ada Lovelace")
    assert hinted.text == _chat_text(client, "transcribe", language="en", prompt="Ada Lovelace")
    # Another clip is another prompt: the audio reached the thinker.
    other = wav_bytes(_tone(1300.0, 0.5))
    assert _transcribe(client, file=("b.wav", other)).text == _chat_text(client, "transcribe", other, language=None,
                                                                        prompt=None)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # the client marks translations.create deprecated
def test_translation_is_the_thinkers_answer(client):
    got = client.audio.translations.create(model="tiny-omni", file=("tone.wav", WAV), extra_body=EXTRA)
    assert got.text == _chat_text(client, "translate", language=None, prompt=None)


def test_flac_and_mp3_files(client):
    flac = io.BytesIO()
    soundfile.write(flac, _tone(440.0), 16000, format="FLAC")
    assert _transcribe(client, file=("tone.flac", flac.getvalue())).text == _transcribe(client).text   # lossless
    if "MP3" in _decoders():
        mp3 = io.BytesIO()
        soundfile.write(mp3, _tone(440.0).astype(np.float32) / 32768, 16000, format="MP3")
        assert isinstance(_transcribe(client, file=("tone.mp3", mp3.getvalue())).text, str)


def test_response_formats(client, server):
    doc = requests.get(server.url + "/openapi.json", timeout=10).json()["paths"]["/v1/audio/transcriptions"]["post"]
    form = doc["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]
    assert form["response_format"]["enum"] == list(FORMATS) == list(openapi_text_routes.FORMATS)
    assert form["model"]["enum"] == ["tiny-omni"]   # the LLM beside it cannot hear
    text = _transcribe(client).text
    assert _transcribe(client, response_format="text") == text
    verbose = _transcribe(client, response_format="verbose_json", language="en")
    assert (verbose.text, verbose.language, verbose.duration) == (_transcribe(client, language="en").text, "en", 1.0)
    assert _transcribe(client, response_format="verbose_json").language == "und"   # nothing detects it
    assert _transcribe(client, response_format="srt") == f"1\n00:00:00,000 --> 00:00:01,000\n{text}\n\n"
    assert _transcribe(client, response_format="vtt") == f"WEBVTT\n\n00:00:00.000 --> 00:00:01.000\n{text}\n\n"


def test_stream_gives_deltas_then_done(client, server):
    whole = _transcribe(client).text
    events = list(_transcribe(client, stream=True))
    assert [e.type for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1)
    done = events[-1]
    assert done.type == "transcript.text.done" and done.text == whole
    assert "".join(e.delta for e in events[:-1]).strip() == whole
    assert done.usage.output_tokens == MAX and done.usage.input_tokens > 0
    # The same stream as vLLM's clients read it: transcription.chunk objects ending [DONE].
    raw = requests.post(server.url + "/v1/audio/transcriptions", files={"file": ("t.wav", WAV)},
                        data={"model": "tiny-omni", "stream": "true", "max_completion_tokens": str(MAX)}, timeout=60)
    lines = [line[6:] for line in raw.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert all(c["object"] == "transcription.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks).strip() == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("kwargs, status, param", [
    ({"model": "tiny-llm"}, 422, "model"),
    ({"file": ("x.wav", b"not audio at all")}, 400, "file"),
    ({"response_format": "xml"}, 400, "response_format"),
    ({"timestamp_granularities": ["word"]}, 422, "timestamp_granularities"),
    ({"language": "English"}, 400, "language"),
    ({"extra_body": {"max_completion_tokens": MAX, "beam_size": 4}}, 422, "beam_size"),
    ({"file": ("long.wav", wav_bytes(_tone(300.0, 31.0)))}, 400, "file"),
])
def test_what_cannot_be_served_is_refused_by_name(client, kwargs, status, param):
    kwargs = {"model": "tiny-omni", "file": ("tone.wav", WAV), "extra_body": EXTRA, **kwargs}
    with pytest.raises(openai.APIStatusError) as err:
        client.audio.transcriptions.create(**kwargs)
    assert err.value.status_code == status and err.value.body["param"] == param, err.value.body


def test_responses_take_audio_and_image_parts(client):
    b64 = base64.b64encode(WAV).decode()
    png = random_png(0, (64, 48))
    resp = client.responses.create(model="tiny-omni", max_output_tokens=MAX, temperature=0, input=[{
        "role": "user", "content": [
            {"type": "input_text", "text": "Listen and look:"},
            {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
            {"type": "input_image", "image_url": image_part(png)["image_url"]["url"], "detail": "auto"}]}])
    chat = client.chat.completions.create(model="tiny-omni", max_tokens=MAX, temperature=0, messages=[{
        "role": "user", "content": [{"type": "text", "text": "Listen and look:"}, audio_part(WAV), image_part(png)]}])
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
