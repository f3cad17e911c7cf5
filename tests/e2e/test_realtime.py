"""The WebSocket routes: ``/v1/realtime`` (OpenAI's Realtime events, turn by turn) and
``/v1/audio/speech/stream`` (text in as typed, speech out), against real daemons serving the tiny
Qwen2.5-Omni (encode → prefill → decode → generate), through aiohttp's WebSocket client.

The pure parts (sentence cutting, WAV wrapping, session validation) are tested without a cluster.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import struct
import time
import wave

import aiohttp
import numpy as np
import pytest

from omnirelay.errors import BadRequest, NotFound, Unprocessable
from omnirelay.gateway.routes.realtime import SessionConfig, wav_clip
from omnirelay.gateway.routes.speech_ws import split_sentences

from cluster import Cluster, settled_workers
from repo_paths import REPO_ROOT

MODEL = "tiny-omni"
PIPELINE = str(REPO_ROOT / "deploy" / "pipelines" / "omni.yaml")


# ------------------------------------------------------------------ without a cluster


def test_sentences_are_cut_at_their_ends_and_the_rest_waits():
    assert split_sentences("Hello there. How are") == (["Hello there."], "How are")
    assert split_sentences("One! Two? Three.") == (["One!", "Two?"], "Three.")
    assert split_sentences("line one\nline two\n") == (["line one", "line two"], "")
    assert split_sentences("你好。再见") == (["你好。"], "再见")
    assert split_sentences("3.14 is pi") == ([], "3.14 is pi")     # no space after the dot: not an end
    assert split_sentences("") == ([], "")


def test_wav_clip_wraps_pcm16_mono():
    pcm = struct.pack("<4h", 0, 1000, -1000, 32767)
    with wave.open(io.BytesIO(wav_clip(pcm, 16000))) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate(), wav.getnframes()) == (1, 2, 16000, 4)
        assert wav.readframes(4) == pcm


class _Model:
    """What SessionConfig.updated reads of a served model: its name and directory (voices)."""


def test_session_update_validates_each_field(tmp_path):
    from omnirelay.gateway.models import ModelRuntime
    from omnirelay.gateway.speech_facts import SpeechFacts
    model = ModelRuntime.__new__(ModelRuntime)
    model.name, model.path, model.stages, model.media = "m", str(tmp_path), ("prefill", "decode"), None
    (tmp_path / "spk_dict.json").write_text(json.dumps({"Ethan": {}, "Chelsie": {}}))
    model.speech = SpeechFacts.read(str(tmp_path))   # read once, as ModelRuntime does when it loads
    models = {"m": model}
    config = SessionConfig(model="m")
    assert config.updated({"audio": {"output": {"voice": "Ethan"}}}, models).voice == "Ethan"
    assert config.updated({"output_modalities": ["text"]}, models).output_modalities == ("text",)
    assert config.updated({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, models).input_rate \
        == 16000
    assert config.updated({"max_output_tokens": "inf"}, models).max_output_tokens is None
    cases = [({"model": "nope"}, NotFound, "session.model"),
             ({"audio": {"output": {"voice": "Nobody"}}}, BadRequest, "session.audio.output.voice"),
             ({"output_modalities": ["audio", "text"]}, BadRequest, "session.output_modalities"),
             ({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}, Unprocessable, "session.audio.input.format"),
             ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 100}}}}, BadRequest,
              "session.audio.input.format.rate"),
             ({"max_output_tokens": 0}, BadRequest, "session.max_output_tokens"),
             ({"tools": [{"type": "function"}]}, Unprocessable, "session.tools"),
             ("not an object", BadRequest, "session")]
    for raw, error, param in cases:
        with pytest.raises(error) as info:
            config.updated(raw, models)
        assert info.value.param == param, raw


# ------------------------------------------------------------------ against real daemons


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from omnirelay.deploy.builders.omni import build_tiny_omni
    model = str(build_tiny_omni(tmp_path_factory.mktemp("models") / MODEL, seed=0))
    c = Cluster(model, str(tmp_path_factory.mktemp("realtime-logs")), model_name=MODEL)
    try:
        c.start_broker()
        for role in ("encode", "prefill", "decode", "generate"):
            c.start_worker(role, "--stage-configs-path", PIPELINE)
        c.start_gateway("--stage-configs-path", PIPELINE, "--max-websocket-sessions", "3",
                        "--websocket-idle-timeout", "4")
        c.wait_healthy(timeout=240)
        yield c
    finally:
        c.stop()


def _ws_url(cluster, path: str) -> str:
    return cluster.url.replace("http://", "ws://") + path


def _tone(seconds: float, rate: int) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (np.sin(2 * math.pi * 440 * t) * 12000).astype("<i2").tobytes()


async def _until(ws, kind: str, timeout: float = 180.0) -> list[dict]:
    """Every event up to and including the first of type ``kind``."""
    events = []
    deadline = time.monotonic() + timeout
    while True:
        message = await ws.receive(timeout=max(0.1, deadline - time.monotonic()))
        assert message.type == aiohttp.WSMsgType.TEXT, message
        events.append(json.loads(message.data))
        if events[-1]["type"] == kind:
            return events


async def _send(ws, event: dict) -> None:
    await ws.send_str(json.dumps(event))


def _pcm(events: list[dict], kind: str) -> np.ndarray:
    return np.frombuffer(b"".join(base64.b64decode(e["delta" if "delta" in e else "audio"]) for e in events
                                  if e["type"] == kind), dtype="<i2")


@pytest.mark.slow
def test_realtime_turn_audio_in_chunks_speech_and_transcript_out(cluster):
    async def session():
        async with aiohttp.ClientSession() as http, http.ws_connect(_ws_url(cluster, f"/v1/realtime?model={MODEL}")) as ws:
            created = await _until(ws, "session.created")
            assert created[-1]["session"]["model"] == MODEL
            await _send(ws, {"type": "session.update", "session": {
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}, "output": {"voice": "Ethan"}},
                "max_output_tokens": 12}})
            updated = (await _until(ws, "session.updated"))[-1]["session"]
            assert updated["audio"]["output"]["voice"] == "Ethan" and updated["output_modalities"] == ["audio"]
            pcm = _tone(1.0, 16000)
            for start in range(0, len(pcm), 3200):   # 100 ms a chunk, as a microphone would send it
                await _send(ws, {"type": "input_audio_buffer.append",
                                 "audio": base64.b64encode(pcm[start:start + 3200]).decode()})
            await _send(ws, {"type": "input_audio_buffer.commit"})
            committed = await _until(ws, "conversation.item.done")
            assert [e["type"] for e in committed] == ["input_audio_buffer.committed", "conversation.item.added",
                                                      "conversation.item.done"]
            await _send(ws, {"type": "response.create"})
            return await _until(ws, "response.done")

    events = asyncio.run(session())
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.output_item.added"]
    assert kinds[-4:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                          "response.output_item.done", "response.done"]
    done = events[-1]["response"]
    assert done["status"] == "completed", done
    assert done["usage"]["output_tokens"] >= 2 and done["usage"]["input_tokens"] > 0
    audio = _pcm(events, "response.output_audio.delta")
    assert len(audio) > 2400 and audio.std() > 0, "no speech came back"
    transcript = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    assert transcript == events[-3]["transcript"] == done["output"][0]["content"][0]["transcript"]


@pytest.mark.slow
def test_realtime_text_turns_keep_the_conversation_and_bad_events_keep_the_session(cluster):
    async def session():
        async with aiohttp.ClientSession() as http, http.ws_connect(_ws_url(cluster, "/v1/realtime")) as ws:
            await _until(ws, "session.created")
            errors = []
            for bad in ("not json", json.dumps({"type": "no.such.event"}),
                        json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}),
                        json.dumps({"type": "input_audio_buffer.commit"}),
                        json.dumps({"type": "response.create"}),
                        json.dumps({"type": "response.cancel"})):
                await ws.send_str(bad)
                errors.append((await _until(ws, "error"))[-1]["error"])
            await _send(ws, {"type": "session.update", "session": {"output_modalities": ["text"],
                                                                   "max_output_tokens": 8}})
            await _until(ws, "session.updated")
            turns = []
            for text in ("Hello!", "And again?"):
                await _send(ws, {"type": "conversation.item.create", "item": {
                    "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
                await _until(ws, "conversation.item.done")
                await _send(ws, {"type": "response.create"})
                turns.append(await _until(ws, "response.done"))
            return errors, turns

    errors, turns = asyncio.run(session())
    assert [e["param"] for e in errors] == [None, "type", "audio", "input_audio_buffer", "response", "response_id"]
    assert all(e["type"] == "invalid_request_error" and e["message"] for e in errors)
    first, second = (t[-1]["response"] for t in turns)
    assert first["status"] == second["status"] == "completed"
    # The second turn's prompt holds the first exchange: more input tokens than the first turn.
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    for events in turns:
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text == next(e["text"] for e in events if e["type"] == "response.output_text.done")


@pytest.mark.slow
def test_a_client_that_leaves_mid_answer_frees_every_stage(cluster):
    # The workers' figures travel in heartbeats: read once the cluster says they are final.
    free_before = {w["role"]: w["free_kv_blocks"] for w in settled_workers(cluster.url)}

    async def leave_mid_answer():
        async with aiohttp.ClientSession() as http, http.ws_connect(_ws_url(cluster, "/v1/realtime")) as ws:
            await _until(ws, "session.created")
            await _send(ws, {"type": "session.update", "session": {"audio": {"output": {"voice": "Chelsie"}},
                                                                   "max_output_tokens": 400}})
            await _until(ws, "session.updated")
            await _send(ws, {"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk for long."}]}})
            await _send(ws, {"type": "response.create"})
            await _until(ws, "response.output_audio_transcript.delta")
            # leaving the block closes the socket while the answer is still being generated

    asyncio.run(leave_mid_answer())
    # Settled: every stage let the request go (cancelled) and a heartbeat since says so.
    workers = settled_workers(cluster.url, timeout=60)
    free = {w["role"]: w["free_kv_blocks"] for w in workers}
    assert free == free_before and not any(w["running"] + w["waiting"] for w in workers), workers
    assert cluster.broker_counters().get("cancellations", 0) >= 1


@pytest.mark.slow
def test_session_limit_and_idle_timeout(cluster):
    async def limits():
        async with aiohttp.ClientSession() as http:
            sockets = [await http.ws_connect(_ws_url(cluster, "/v1/realtime")) for _ in range(3)]
            with pytest.raises(aiohttp.WSServerHandshakeError) as info:
                await http.ws_connect(_ws_url(cluster, "/v1/audio/speech/stream"))
            assert info.value.status == 503
            await sockets[0].close()
            started = time.monotonic()
            idle = await _until(sockets[1], "error", timeout=30)    # nothing sent: closed after 4 s
            closed = await sockets[1].receive(timeout=10)
            assert closed.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
            for ws in sockets[2:]:
                await ws.close()
            return idle[-1]["error"]["message"], time.monotonic() - started

    message, waited = asyncio.run(limits())
    assert "idle" in message and waited < 20


@pytest.mark.slow
def test_speech_stream_speaks_each_sentence_as_it_is_typed(cluster):
    async def session():
        async with aiohttp.ClientSession() as http, \
                http.ws_connect(_ws_url(cluster, "/v1/audio/speech/stream")) as ws:
            await _until(ws, "session.created")
            await _send(ws, {"type": "session.update", "session": {"model": MODEL, "voice": "Nobody"}})
            bad_voice = (await _until(ws, "error"))[-1]["error"]
            await _send(ws, {"type": "input_text.append", "text": "too early"})
            no_session = (await _until(ws, "error"))[-1]["error"]
            await _send(ws, {"type": "session.update", "session": {"model": MODEL, "voice": "Ethan", "seed": 7}})
            await _until(ws, "session.updated")
            for piece in ("Hello there. How ", "are you", " today"):
                await _send(ws, {"type": "input_text.append", "text": piece})
            first = await _until(ws, "speech.audio.done")     # the first sentence, spoken before the rest is typed
            await _send(ws, {"type": "input_text.end"})
            second = await _until(ws, "speech.audio.done")
            closed = await ws.receive(timeout=30)
            return bad_voice, no_session, first, second, closed

    bad_voice, no_session, first, second, closed = asyncio.run(session())
    assert bad_voice["param"] == "session.voice" and no_session["param"] == "session"
    assert first[-1]["text"] == "Hello there." and second[-1]["text"] == "How are you today"
    for events in (first, second):
        item = events[-1]["item_id"]
        assert {e["item_id"] for e in events if e["type"] == "speech.audio.delta"} == {item}
        audio = _pcm(events, "speech.audio.delta")
        assert len(audio) > 0 and audio.std() > 0
        assert events[-1]["usage"]["input_tokens"] > 0
    assert closed.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
