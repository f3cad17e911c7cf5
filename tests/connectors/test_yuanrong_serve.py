"""``omni-serve --connector yuanrong`` end to end: the datasystem worker it starts and stops, and an
outage of that worker in the middle of a run.

The prefill → decode hand-off of the tiny LM crosses an openYuanrong datasystem worker: one that
omni-serve starts on free ports in its run directory (and must stop, leaving no process and no
directory), or one given by ``--yuanrong-address``, which the outage test kills (SIGKILL to its
process group) and starts again on the same ports. Greedy answers must equal transformers'. The
tiny Qwen2.5-Omni runs with every edge on yuanrong and must answer exactly as over shared memory.
"""

from __future__ import annotations

import base64
import io
import os
import time

import numpy as np
import openai
import pytest
import yaml
from PIL import Image

from cluster import settled_workers
from conftest import ServeProcess, pid_alive
from repo_paths import REPO_ROOT
from yuanrong_support import started_yuanrong_worker

PROMPT = "What is the capital of France?"
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _client(serve: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI) -> list[int]:
    response = client.chat.completions.create(
        model="tiny-llm", messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=16,
        extra_body={"return_token_ids": True})
    return response.choices[0].model_extra["token_ids"]


def _datasystem_worker(pids: set[int]) -> tuple[int, str]:
    """(pid, directory) of the datasystem worker among ``pids``."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = handle.read().decode().split("\0")
        except OSError:
            continue
        if argv and argv[0].endswith("datasystem_worker"):
            ready = next(arg for arg in argv if arg.startswith("-ready_check_path="))
            return pid, os.path.dirname(ready.split("=", 1)[1])
    raise AssertionError(f"no datasystem_worker among omni-serve's children {sorted(pids)}")


def test_chat_over_the_datasystem_worker_omni_serve_starts(tiny_model, reference, tmp_path):
    serve = ServeProcess(tiny_model, "--served-model-name", "tiny-llm", "--connector", "yuanrong",
                         "--log-level", "WARNING", log_path=str(tmp_path / "serve.log"))
    try:
        pid, directory = _datasystem_worker(serve.children)
        assert os.path.isdir(directory)
        assert _chat(_client(serve)) == reference(PROMPT, 16)
        workers = {w["role"]: w for w in settled_workers(serve.url)}
        put = workers["prefill"]["stats"].get("connector_bytes_put", 0)
        assert put > 0 and workers["decode"]["stats"].get("connector_bytes_got", 0) == put
    finally:
        assert serve.stop() == 0, serve.output()[-3000:]
    assert not pid_alive(pid), "omni-serve left its datasystem worker running"
    assert not os.path.exists(directory), f"omni-serve left {directory} behind"


def test_datasystem_worker_killed_mid_run_fails_requests_then_serving_resumes(tiny_model, reference, tmp_path):
    store = started_yuanrong_worker(shared_memory_mb=256)
    serve = None
    try:
        serve = ServeProcess(tiny_model, "--served-model-name", "tiny-llm", "--connector", "yuanrong",
                             "--yuanrong-address", store.address, "--log-level", "WARNING",
                             log_path=str(tmp_path / "serve.log"))
        client = _client(serve)
        want = reference(PROMPT, 16)
        assert _chat(client) == want

        store.kill()
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            _chat(client)
        failed_after = time.monotonic() - t0
        body = info.value.body if isinstance(info.value.body, dict) else {}
        # One structured error (the project's table), after the broker's bounded restarts, never a
        # hang; the first call to the dead worker stalls its process for the connector's request
        # timeout (2 s, the client holds the GIL), the later ones fail at once (connectors/yuanrong.py).
        assert info.value.status_code in (502, 503, 504), info.value
        assert body.get("code") in ("transfer_failed", "unavailable", "deadline_exceeded"), body
        assert failed_after < 60, failed_after
        print(f"request failed {failed_after:.1f}s after the datasystem worker was killed: "
              f"{info.value.status_code} {body}")

        store.restart()
        assert _chat(client) == want   # the same workers and connectors serve again
        assert "missed heartbeats" not in serve.output(), serve.output()[-3000:]
    finally:
        if serve is not None:
            assert serve.stop() == 0, serve.output()[-3000:]
        store.stop()
    assert not os.path.exists(store.directory)


def _omni_requests(client: openai.OpenAI, png: bytes) -> dict:
    """A spoken answer to an image (encode → prefill → decode → generate) and a streamed spoken answer
    (decode streams the reply's states to the talker in chunks): their text and audio bytes."""
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    spoken = client.chat.completions.create(
        model="tiny-omni", messages=[{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                                                  {"type": "image_url", "image_url": {"url": url}}]}],
        modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"}, max_tokens=8, temperature=0,
        seed=1234, extra_body={"max_audio_tokens": 16}).choices[0].message.audio
    stream = client.chat.completions.create(
        model="tiny-omni", messages=[{"role": "user", "content": "Say hello to the world"}],
        modalities=["text", "audio"], max_tokens=8, temperature=0, seed=1234, audio={"voice": "Ethan", "format": "wav"},
        stream=True, extra_body={"max_audio_tokens": 72})
    chunks, transcript = [], []
    for event in stream:
        audio = event.choices[0].delta.audio if event.choices else None
        if audio is not None and audio.data:
            chunks.append(base64.b64decode(audio.data))
        if audio is not None and audio.transcript:
            transcript.append(audio.transcript)
    return {"image_transcript": spoken.transcript, "image_audio": base64.b64decode(spoken.data),
            "stream_transcript": "".join(transcript), "stream_chunks": len(chunks), "stream_audio": b"".join(chunks)}


def test_omni_every_edge_on_yuanrong_answers_as_shared_memory(tmp_path):
    """Qwen2.5-Omni's four stages with every edge (encode → prefill, prefill → decode, prefill →
    generate, decode → generate, the last one streamed in chunks) on the datasystem omni-serve
    starts: the same text and audio bytes as over shared memory."""
    from omnirelay.deploy.builders.omni import build_tiny_omni

    model = str(build_tiny_omni(tmp_path / "tiny-omni", seed=0))
    pixels = (np.random.RandomState(5).rand(64, 80, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    answers = {}
    for kind in ("shared_memory", "yuanrong"):
        pipeline = yaml.safe_load((REPO_ROOT / "deploy" / "pipelines" / "omni.yaml").read_text())
        pipeline["connectors"] = {"data": {"type": kind, "options": {"ttl_s": 300}}}
        path = tmp_path / f"omni-{kind}.yaml"
        path.write_text(yaml.safe_dump(pipeline))
        serve = ServeProcess(model, "--served-model-name", "tiny-omni", "--stage-configs-path", str(path),
                             "--log-level", "WARNING", log_path=str(tmp_path / f"serve-{kind}.log"), timeout=300)
        try:
            answers[kind] = _omni_requests(_client(serve), buf.getvalue())
            workers = settled_workers(serve.url)
            put = sum(w["stats"].get("connector_bytes_put", 0) for w in workers)
            got = sum(w["stats"].get("connector_bytes_got", 0) for w in workers)
            assert put > 0 and got > 0, (kind, put, got)
            assert {w["role"] for w in workers} == {"encode", "prefill", "decode", "generate"}
        finally:
            assert serve.stop() == 0, serve.output()[-3000:]
    yuanrong, shared = answers["yuanrong"], answers["shared_memory"]
    assert yuanrong["image_transcript"] and len(yuanrong["image_audio"]) > 44
    assert yuanrong["stream_chunks"] > 1
    assert yuanrong == shared
