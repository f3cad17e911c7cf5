"""``omni-serve`` as a newcomer runs it: starts, serves, and on Ctrl-C or SIGTERM stops every child
and leaves no process and no shared-memory segment behind."""

from __future__ import annotations

import base64
import io
import os
import signal
import time
import wave

import openai
import pytest
import requests

from conftest import ServeProcess, pid_alive, shm_segments_of


def _one_chat(url: str, model: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    response = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}],
                                              max_tokens=8, temperature=0)
    return response.choices[0].message.content


def _assert_clean_exit(serve: ServeProcess, sig: int) -> None:
    children = set(serve.children)
    assert len(children) >= 4, "broker, gateway, prefill and decode run as child processes"
    assert serve.stop(timeout=60, sig=sig) == 0
    deadline = time.time() + 5
    while time.time() < deadline and any(pid_alive(pid) for pid in children):
        time.sleep(0.1)
    assert not [pid for pid in children if pid_alive(pid)], "a child outlived omni-serve"
    assert shm_segments_of(children | {serve.proc.pid}) == []


@pytest.mark.slow
@pytest.mark.timeout(900)   # builds four models and starts ten processes on two cores
def test_embedded_default_serves_every_modality_and_ctrl_c_cleans_up(tmp_path):
    """The newcomer's command: no model given → one embedded model per modality, each answering on
    its own endpoint through the official client; Ctrl-C then leaves nothing behind."""
    env = {**os.environ, "OMNIRELAY_CACHE_DIR": str(tmp_path / "cache")}
    serve = ServeProcess(None, log_path=str(tmp_path / "serve.log"), env=env, timeout=420)
    try:
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny-llm", "tiny-omni", "tiny-sd", "tiny-video"]
        assert _one_chat(serve.url, "tiny-llm")
        picture = client.images.generate(model="tiny-sd", prompt="a red square", size="64x64",
                                         extra_body={"num_inference_steps": 2, "seed": 1})
        assert base64.b64decode(picture.data[0].b64_json).startswith(b"\x89PNG")
        speech = client.audio.speech.create(model="tiny-omni", input="Hello there.", voice="Chelsie",
                                            response_format="wav")
        with wave.open(io.BytesIO(speech.content)) as wav:
            assert wav.getnframes() > 0
        job = client.videos.create(model="tiny-video", prompt="a drifting cloud", size="64x64",
                                   extra_body={"num_inference_steps": 2, "num_frames": 4, "seed": 1})
        deadline = time.time() + 120
        while job.status in ("queued", "in_progress") and time.time() < deadline:
            time.sleep(0.5)
            job = client.videos.retrieve(job.id)
        assert job.status == "completed", job
        assert len(client.videos.download_content(job.id).content) > 0
        assert (tmp_path / "cache").is_dir()
    finally:
        _assert_clean_exit(serve, signal.SIGINT)


def test_sigterm_mid_stream_cleans_up(tiny_model, tmp_path):
    serve = ServeProcess(tiny_model, log_path=str(tmp_path / "serve.log"))
    try:
        assert _one_chat(serve.url, tiny_model) is not None
        body = {"model": tiny_model, "messages": [{"role": "user", "content": "Go on forever."}],
                "max_tokens": 1800, "ignore_eos": True, "temperature": 0, "stream": True}
        with requests.post(serve.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as response:
            lines = response.iter_lines()
            for _ in range(4):
                next(lines)
            serve.proc.send_signal(signal.SIGTERM)
            started = time.time()
            # The stream must end (finished, errored or closed) rather than hang.
            try:
                for _ in lines:
                    pass
            except requests.RequestException:
                pass
            assert time.time() - started < 45
    finally:
        _assert_clean_exit(serve, signal.SIGTERM)
