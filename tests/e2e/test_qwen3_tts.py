"""Qwen3-TTS (12 Hz CustomVoice) served behind ``POST /v1/audio/speech``: the tiny random model that
``omni-make-model tiny-qwen3-tts`` writes, loaded by a real generate worker with the ``qwen_tts``
package's classes (workers/speech/qwen3_tts_package.py), in a real cluster (broker, two generate workers,
gateway as separate processes), driven through the official ``openai`` client.

What is checked: the model's kind and bundled one-stage pipeline; its voices in the OpenAPI
document; a WAV that is not silent (and the same speech for the same seed, as PCM too); streamed
``stream_format: "audio"`` and ``"sse"`` (the same bytes both ways, in several pieces, usage in
12.5 Hz frames); an unknown voice is a 400 naming ``voice`` before anything reaches a worker; and a
generate worker killed mid-job: every request completes with the fault-free audio (the broker
re-dispatches the stage, the seed makes it speak the same) or fails with a structured error, none hangs.

Skipped, with the reason, where the ``qwen_tts`` package is not installed
(``pip install --no-deps qwen-tts-compat==0.1.1.post1``).
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json

import numpy as np
import openai
import pytest
import requests

from cluster import assert_contract, classify, run_load
from media_fixtures import client_fixture
from media_support import (assert_the_kill_was_recovered, kill_busiest_worker, pipeline_cluster, tiny_model_dir,
                           wav_samples)
from omnirelay.workers.speech.qwen3_tts_package import PACKAGE_HINT, ONLY_25HZ_MODULES, load_classes
from repo_paths import REPO_ROOT

# find_spec, not an import: collecting this module must stay cheap when the slow tier is not run.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("qwen_tts") is None,
                                 reason=f"the qwen_tts package is not installed: {PACKAGE_HINT}")]

MODEL = "tiny-qwen3-tts"
PIPELINE = str(REPO_ROOT / "deploy" / "pipelines" / "qwen3_tts.yaml")
SAMPLE_RATE, FRAME_SAMPLES = 24000, 1920
FRAMES = 8               # max_audio_tokens: the random talker rarely says EOS, so this bounds the audio
KILL_FRAMES = 120        # the kill test's answers: long enough to be in flight when the kill comes
TEXT = "Hello there, world."


@pytest.fixture(scope="module")
def tiny_tts(tmp_path_factory) -> str:
    from omnirelay.deploy.builders.qwen3_tts import build_tiny_qwen3_tts
    return tiny_model_dir(tmp_path_factory, MODEL, build_tiny_qwen3_tts)


@pytest.fixture(scope="module")
def cluster(tiny_tts, tmp_path_factory):
    with pipeline_cluster(tiny_tts, str(tmp_path_factory.mktemp("qwen3-tts-logs")), MODEL, PIPELINE,
                          ("generate", "generate"), start_timeout=300) as cluster:
        yield cluster


client = client_fixture(timeout=300)


def _samples(wav_bytes: bytes) -> np.ndarray:
    return wav_samples(wav_bytes, SAMPLE_RATE)


def _rms(samples: np.ndarray) -> float:
    return float(np.sqrt(np.mean((samples / 32767.0) ** 2)))


def test_the_package_loads_and_its_placeholders_do_not_leak():
    """The 25 Hz tokenizer's imports that are not installed were stood in for only during the import."""
    import sys
    missing = [name for name in ONLY_25HZ_MODULES if importlib.util.find_spec(name.split(".")[0]) is None]
    classes = load_classes()
    assert classes.model.__name__ == "Qwen3TTSForConditionalGeneration"
    assert not [name for name in missing if name in sys.modules]
    if "torchaudio" in missing:
        from qwen_tts.core.tokenizer_25hz.vq import speech_vq
        with pytest.raises(ImportError, match="25 Hz"):
            speech_vq.kaldi.fbank()


def test_model_kind_and_bundled_pipeline(tiny_tts):
    from omnirelay.deploy.served_models import bundled_pipeline
    from omnirelay.model_kind import model_kind
    assert model_kind(tiny_tts) == "qwen3-tts"
    assert bundled_pipeline("qwen3-tts") == PIPELINE


def test_voices_are_the_model_speakers(cluster):
    doc = requests.get(cluster.url + "/openapi.json", timeout=30).json()
    speech = doc["paths"]["/v1/audio/speech"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert speech["properties"]["voice"]["enum"] == ["ryan", "vivian"]
    assert speech["properties"]["model"]["enum"] == [MODEL]


def test_speech_wav_is_not_silent_and_follows_the_seed(client):
    kwargs = dict(model=MODEL, voice="vivian", input=TEXT, extra_body={"seed": 7, "max_audio_tokens": FRAMES})
    wav = client.audio.speech.create(response_format="wav", **kwargs)
    samples = _samples(wav.content)
    assert 0 < samples.shape[0] <= FRAMES * FRAME_SAMPLES and samples.shape[0] % FRAME_SAMPLES == 0
    assert _rms(samples) > 0.05, "silent"
    pcm = client.audio.speech.create(response_format="pcm", **kwargs)
    assert np.array_equal(np.frombuffer(pcm.content, dtype="<i2"), samples)   # same seed: the same speech
    other = client.audio.speech.create(response_format="pcm", **{**kwargs, "extra_body": {"seed": 8, "max_audio_tokens": FRAMES}})
    assert other.content != pcm.content   # another seed, other codes


def test_streamed_audio_and_sse_carry_the_same_bytes(client):
    kwargs = dict(model=MODEL, voice="ryan", input=TEXT, response_format="wav",
                  extra_body={"seed": 11, "max_audio_tokens": FRAMES})
    with client.audio.speech.with_streaming_response.create(stream_format="audio", **kwargs) as response:
        assert response.headers["content-type"] == "audio/wav"
        body = response.read()
    samples = _samples(body)
    assert samples.shape[0] > 0 and _rms(samples) > 0.05
    events = []
    with client.audio.speech.with_streaming_response.create(stream_format="sse", **kwargs) as response:
        assert response.headers["content-type"] == "text/event-stream"
        for line in response.iter_lines():
            if line:
                events.append(json.loads(line.removeprefix("data: ")))
    *deltas, done = events
    assert len(deltas) >= 2 and all(e["type"] == "speech.audio.delta" for e in deltas), events
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == body
    assert done["type"] == "speech.audio.done"
    assert done["usage"]["output_tokens"] == samples.shape[0] // FRAME_SAMPLES   # codec frames at 12.5 Hz


def test_unknown_voice_is_a_400_naming_voice(client, cluster):
    with pytest.raises(openai.BadRequestError, match="voice 'alloy' is not available.*ryan, vivian") as caught:
        client.audio.speech.create(model=MODEL, voice="alloy", input="hi", response_format="wav")
    assert caught.value.body["param"] == "voice"
    r = requests.post(cluster.url + "/v1/audio/speech", timeout=30,
                      json={"model": MODEL, "voice": "alloy", "input": "hi", "stream_format": "sse"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "voice" and {"request_id", "stage"} <= set(r.json())


def test_chat_with_the_speech_model_is_refused(client):
    """A TTS model does not chat: a spoken chat answer needs a thinker (400), a plain one too (4xx
    with the error contract's body), never a hang."""
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       modalities=["text", "audio"], audio={"voice": "vivian", "format": "wav"})
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       timeout=60)
    assert 400 <= caught.value.status_code < 500, caught.value


async def _speech(client: openai.AsyncOpenAI, i: int) -> bytes:
    response = await client.audio.speech.create(model=MODEL, voice=("vivian", "ryan")[i % 2], input=f"{TEXT} {i}",
                                                response_format="pcm",
                                                extra_body={"seed": 100 + i, "max_audio_tokens": KILL_FRAMES})
    return response.content


def test_generate_worker_killed_mid_job(cluster):
    """kill -9 of the busy generate worker under a small load: each request completes with its
    fault-free audio (re-dispatched, same seed: same speech) or a structured error; none hangs."""
    n = 6
    baseline = [audio for _, audio in asyncio.run(run_load(cluster.url, _speech, n, concurrency=2, timeout_s=240))]
    assert all(isinstance(audio, bytes) and audio for audio in baseline)
    retries_before = cluster.broker_counters().get("stage_retries", 0)
    killed = {}

    results = asyncio.run(run_load(cluster.url, _speech, n, concurrency=2, timeout_s=240,
                                   fault=lambda: kill_busiest_worker(cluster, killed), after=1))
    counts = classify(results, baseline)
    print(f"\nkill -9 Qwen3-TTS generate: {counts} (victim held {killed.get('busy')} task(s))")
    assert_contract(counts, results)
    assert_the_kill_was_recovered(cluster, killed, retries_before, "Qwen3-TTS generate")
    survivor = asyncio.run(run_load(cluster.url, _speech, 1, concurrency=1, timeout_s=240))
    assert survivor == [("completed", baseline[0])]
