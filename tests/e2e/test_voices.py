"""``/v1/audio/voices`` against a real gateway serving the tiny Qwen2.5-Omni (its speaker table) and
a text model: the list, and the checks of an upload and a delete (the served families clone no
voice, so a well-formed upload is a 422 naming ``model``)."""

from __future__ import annotations

import io
import wave

import pytest
import requests

from cluster import Cluster
from repo_paths import REPO_ROOT

MODEL = "tiny-omni"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    from omnirelay.deploy.builders.llm import build_tiny_llm
    from omnirelay.deploy.builders.omni import build_tiny_omni
    models = tmp_path_factory.mktemp("models")
    omni = build_tiny_omni(models / MODEL, seed=0)
    llm = build_tiny_llm(models / "tiny-llm", seed=0)
    pipelines = REPO_ROOT / "deploy" / "pipelines"
    c = Cluster(str(omni), str(tmp_path_factory.mktemp("voices-logs")), model_name=MODEL)
    try:
        c.start_broker()
        c.start_gateway("--stage-configs-path", str(pipelines / "omni.yaml"),
                        "--model", str(llm), "--served-model-name", "tiny-llm")
        yield c
    finally:
        c.stop()


def _wav(seconds: float, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x10\x00" * int(seconds * rate))
    return out.getvalue()


def test_voices_are_listed_per_speech_model(gateway):
    listing = requests.get(gateway.url + "/v1/audio/voices", timeout=30).json()
    assert listing["object"] == "list"
    assert [(v["model"], v["id"], v["type"]) for v in listing["data"]] == \
        [(MODEL, "Chelsie", "preset"), (MODEL, "Ethan", "preset")]
    assert requests.get(gateway.url + "/v1/audio/voices", params={"model": MODEL}, timeout=30).json() == listing
    missing = requests.get(gateway.url + "/v1/audio/voices", params={"model": "tiny-llm"}, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


@pytest.mark.parametrize("fields, clip, status, param", [
    ({"model": MODEL, "name": "mine"}, _wav(1.0), 422, "model"),        # well-formed: the family clones no voice
    ({"model": "tiny-llm", "name": "mine"}, _wav(1.0), 404, "model"),
    ({"model": MODEL, "name": "no spaces"}, _wav(1.0), 400, "name"),
    ({"model": MODEL, "name": "Ethan"}, _wav(1.0), 400, "name"),
    ({"model": MODEL, "name": "mine"}, b"not a wav at all", 400, "file"),
    ({"model": MODEL, "name": "mine"}, _wav(61.0, 8000), 400, "file"),
])
def test_voice_uploads_are_checked(gateway, fields, clip, status, param):
    response = requests.post(gateway.url + "/v1/audio/voices", data=fields, timeout=30,
                             files={"file": ("clip.wav", clip, "audio/wav")})
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_upload_over_the_limit_and_deletes(gateway):
    big = requests.post(gateway.url + "/v1/audio/voices", data={"model": MODEL, "name": "big"}, timeout=60,
                        files={"file": ("clip.wav", b"\0" * (11 * 1024 * 1024), "audio/wav")})
    assert big.status_code == 413
    preset = requests.delete(gateway.url + "/v1/audio/voices/Ethan", timeout=30)
    assert preset.status_code == 422 and preset.json()["error"]["param"] == "name"
    assert requests.delete(gateway.url + "/v1/audio/voices/nobody", timeout=30).status_code == 404
    # The gateway still serves after every refusal.
    assert requests.get(gateway.url + "/v1/audio/voices", timeout=30).status_code == 200
