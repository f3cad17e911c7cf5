"""``/v1/realtime`` with server-side turn detection (Silero VAD, gateway/vad.py) and the session and
response fields that are served or refused by name, through the official ``openai`` client's
``client.realtime.connect`` against the real daemons of tests/e2e/test_realtime.py (tiny Qwen2.5-Omni).

The spoken question is synthesised: voiced syllables (a glottal pulse train at a gliding pitch through
three vowel formant resonators, Hann-shaped), which Silero hears as speech, where a pure tone or white
noise is not (checked below). The detector itself is tested without a cluster first.
"""

from __future__ import annotations

import asyncio
import base64
import math

import numpy as np
import openai
import pytest

from omnirelay.errors import BadRequest, Unprocessable
from omnirelay.gateway.vad import SpeechDetector, SpeechStarted, SpeechStopped, TurnDetection

from test_realtime import MODEL, cluster  # noqa: F401 - the module's daemons, reused as a fixture

RATE = 24000
FORMANTS = {"a": ((730, 90), (1090, 110), (2440, 170)), "i": ((270, 60), (2290, 100), (3010, 170)),
            "u": ((300, 60), (870, 90), (2240, 170)), "e": ((530, 60), (1840, 100), (2480, 150))}


def _resonate(x: np.ndarray, freq: float, bandwidth: float, rate: int) -> np.ndarray:
    """A two-pole resonator (one formant) over ``x``."""
    r = math.exp(-math.pi * bandwidth / rate)
    a1, a2, gain = 2 * r * math.cos(2 * math.pi * freq / rate), -r * r, 1 - r
    y = np.zeros(len(x))
    y1 = y2 = 0.0
    for n, v in enumerate(x):
        y1, y2 = gain * v + a1 * y1 + a2 * y2, y1
        y[n] = y1
    return y


def spoken(vowels: str, rate: int = RATE) -> bytes:
    """Voiced syllables, 180 ms each with 40 ms gaps, as PCM16 mono at ``rate``."""
    pieces = []
    for n, vowel in enumerate(vowels):
        length = int(0.18 * rate)
        pitch = (110 + 15 * (n % 3)) * (1 + 0.08 * np.sin(2 * np.pi * 3 * np.arange(length) / rate))
        phase = np.cumsum(pitch / rate)
        y = (np.diff(np.floor(phase), prepend=0) > 0).astype(float)   # one pulse per glottal period
        for freq, bandwidth in FORMANTS[vowel]:
            y = _resonate(y, freq, bandwidth, rate)
        pieces += [y * np.hanning(length), np.zeros(int(0.04 * rate))]
    x = np.concatenate(pieces)
    return (0.5 * x / np.abs(x).max() * 32767).astype("<i2").tobytes()


def silence(seconds: float, rate: int = RATE) -> bytes:
    return bytes(2 * int(seconds * rate))


QUESTION = spoken("aiueaiu")          # 1.54 s
QUESTION_MS = 1540


# ------------------------------------------------------------------ the detector, without a cluster


@pytest.mark.parametrize("rate", [8000, 16000, 24000, 44100])
def test_detector_finds_the_spoken_turn_at_any_input_rate(rate):
    turns = TurnDetection(prefix_padding_ms=200, silence_duration_ms=400)
    detector = SpeechDetector(turns, rate)
    audio = silence(0.5, rate) + spoken("aiueaiu", rate) + silence(1.0, rate)
    events = []
    for start in range(0, len(audio), 2 * rate // 10):   # 100 ms an append
        events += detector.feed(audio[start:start + 2 * rate // 10])
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped], events
    started, stopped = events
    # Speech begins at 500 ms: found within a few 32 ms windows, reported with the padding before it.
    assert 500 - 200 - 32 <= started.audio_start_ms <= 500 - 200 + 4 * 32
    # It ends at 500 + 1540 ms; the stop comes after 400 ms of silence (a trailing syllable's decay
    # may still count as speech for a window or two).
    assert 2040 + 400 <= stopped.audio_end_ms <= 2040 + 400 + 6 * 32
    assert not detector.speaking


def test_detector_hears_no_speech_in_a_tone_noise_or_silence():
    t = np.arange(RATE) / RATE
    tone = (np.sin(2 * np.pi * 440 * t) * 12000).astype("<i2").tobytes()
    noise = (np.random.default_rng(0).standard_normal(RATE) * 6000).astype("<i2").tobytes()
    for audio in (tone, noise, silence(1.0)):
        assert SpeechDetector(TurnDetection(), RATE).feed(audio) == []


def test_turn_detection_fields_are_validated_by_name():
    assert TurnDetection.parse(None, "td") is None
    assert TurnDetection.parse({"type": "server_vad"}, "td") == TurnDetection()
    parsed = TurnDetection.parse({"type": "server_vad", "threshold": 0.7, "prefix_padding_ms": 100,
                                  "silence_duration_ms": 200, "create_response": False,
                                  "interrupt_response": False}, "td")
    assert parsed == TurnDetection(0.7, 100, 200, False, False)
    cases = [({"type": "semantic_vad"}, Unprocessable, "td.type"),
             ({"type": "server_vad", "threshold": 2}, BadRequest, "td.threshold"),
             ({"type": "server_vad", "silence_duration_ms": -1}, BadRequest, "td.silence_duration_ms"),
             ({"type": "server_vad", "create_response": "yes"}, BadRequest, "td.create_response"),
             ({"type": "server_vad", "idle_timeout_ms": 5000}, Unprocessable, "td.idle_timeout_ms"),
             ({"type": "server_vad", "eagerness": "low"}, Unprocessable, "td.eagerness")]
    for raw, error, param in cases:
        with pytest.raises(error) as info:
            TurnDetection.parse(raw, "td")
        assert info.value.param == param, raw


# ------------------------------------------------------------------ through the openai client


def _connect(cluster):  # noqa: F811 - the fixture's value
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused")
    return client, client.realtime.connect(model=MODEL, max_retries=0)


async def _until(connection, kind: str | tuple[str, ...], timeout: float = 60.0) -> list:
    """Every server event up to and including the first of type ``kind`` (or of one of them), as dicts."""
    kinds = (kind,) if isinstance(kind, str) else kind
    events = []
    try:
        async with asyncio.timeout(timeout):
            while True:
                events.append((await connection.recv()).model_dump())
                if events[-1]["type"] in kinds:
                    return events
    except TimeoutError:
        raise AssertionError(f"no {kind} in {timeout:.0f} s; got {[e['type'] for e in events]}") from None


async def _append(connection, pcm: bytes) -> None:
    for start in range(0, len(pcm), 4800):   # 100 ms an event, as a microphone sends it
        await connection.input_audio_buffer.append(audio=base64.b64encode(pcm[start:start + 4800]).decode())


VAD = {"type": "server_vad", "prefix_padding_ms": 200, "silence_duration_ms": 400}


@pytest.mark.slow
def test_server_vad_commits_a_spoken_question_and_answers_it_without_a_client_commit(cluster):  # noqa: F811
    async def session():
        client, manager = _connect(cluster)
        async with client, manager as connection:
            await _until(connection, "session.created")
            await connection.session.update(session={"type": "realtime", "max_output_tokens": 6, "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": RATE}, "turn_detection": VAD,
                          "transcription": {"language": "en"}},   # by the session's model
                "output": {"voice": "ethan"}}})     # voice names match whatever their case
            updated = (await _until(connection, "session.updated"))[-1]["session"]
            await _append(connection, silence(0.3) + QUESTION + silence(0.7))
            events = await _until(connection, "response.done")
            kinds = [e["type"] for e in events]
            if "conversation.item.input_audio_transcription.completed" not in kinds:
                events += await _until(connection, "conversation.item.input_audio_transcription.completed")
            return updated, events

    updated, events = asyncio.run(session())
    transcript = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    events = [e for e in events if not e["type"].startswith("conversation.item.input_audio_transcription.")]
    events = events[:next(i for i, e in enumerate(events) if e["type"] == "response.done") + 1]
    assert updated["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 400
    assert updated["audio"]["output"]["voice"] == "Ethan"
    kinds = [e["type"] for e in events]
    turn = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
            "conversation.item.added", "conversation.item.done", "response.created"]
    assert kinds[:len(turn)] == turn, kinds
    started, stopped, committed, added = events[:4]
    item = started["item_id"]
    assert stopped["item_id"] == committed["item_id"] == added["item"]["id"] == item
    assert added["item"]["role"] == "user" and added["item"]["content"][0]["type"] == "input_audio"
    assert 300 - 200 - 32 <= started["audio_start_ms"] <= 300 - 200 + 4 * 32
    assert 300 + QUESTION_MS + 400 <= stopped["audio_end_ms"] <= 300 + QUESTION_MS + 700
    done = events[-1]["response"]
    assert done["status"] == "completed", done
    assert done["conversation_id"] and done["usage"]["output_tokens"] >= 2
    audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    assert len(audio) > 0, "the answer was not spoken"
    served = updated["audio"]["input"]["transcription"]
    assert (served["model"], served["language"], served["prompt"]) == (MODEL, "en", "")
    assert transcript["item_id"] == item and transcript["usage"]["input_tokens"] > 0
    assert transcript["usage"]["output_tokens"] >= 1 and isinstance(transcript["transcript"], str)


@pytest.mark.slow
def test_fields_not_served_and_unknown_voices_are_error_events_naming_them(cluster):  # noqa: F811
    session_cases = [
        ({"audio": {"output": {"voice": "Nobody"}}}, "session.audio.output.voice"),
        ({"audio": {"input": {"transcription": {"model": "whisper-1"}}}}, "session.audio.input.transcription.model"),
        ({"audio": {"input": {"noise_reduction": {"type": "near_field"}}}}, "session.audio.input.noise_reduction"),
        ({"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}, "session.audio.input.turn_detection.type"),
        ({"audio": {"output": {"speed": 3.0}}}, "session.audio.output.speed"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "session.tools"),
    ]
    response_cases = [
        ({"audio": {"output": {"voice": "Nobody"}}}, "response.audio.output.voice"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "response.tools"),
        ({"tool_choice": "required"}, "response.tool_choice"),
        ({"conversation": "conv_other"}, "response.conversation"),
        ({"input": []}, "response.input"),
    ]

    async def session():
        client, manager = _connect(cluster)
        async with client, manager as connection:
            await _until(connection, "session.created")
            errors = []
            for fields, _ in session_cases:
                await connection.session.update(session={"type": "realtime", **fields})
                errors.append((await _until(connection, "error"))[-1]["error"])
            await connection.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                                     "max_output_tokens": 3, "audio": {"output": {
                                                         "speed": 1.25, "voice": "Ethan"}}})
            await _until(connection, "session.updated")
            await connection.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Hello!"}]})
            await _until(connection, "conversation.item.done")
            for fields, _ in response_cases:
                await connection.response.create(response=fields)
                errors.append((await _until(connection, "error"))[-1]["error"])
            # Out of band: the reply stays out of the conversation, so the next prompt is the same.
            await connection.response.create(response={"conversation": "none", "metadata": {"topic": "oob"}})
            out_of_band = (await _until(connection, "response.done"))[-1]["response"]
            await connection.response.create(response={"audio": {"output": {"voice": "Chelsie"}}})
            in_band = (await _until(connection, "response.done"))[-1]["response"]
            await connection.response.create()
            after = (await _until(connection, "response.done"))[-1]["response"]
            await connection.response.create(response={"output_modalities": ["audio"],
                                                       "audio": {"output": {"voice": "chelsie"}}})
            spoken_reply = await _until(connection, "response.done")
            return errors, out_of_band, in_band, after, spoken_reply

    errors, out_of_band, in_band, after, spoken_reply = asyncio.run(session())
    assert [e["param"] for e in errors] == [param for _, param in session_cases + response_cases]
    assert all(e["message"] for e in errors)
    assert out_of_band["status"] == in_band["status"] == after["status"] == "completed"
    assert out_of_band["conversation_id"] is None and out_of_band["metadata"] == {"topic": "oob"}
    assert in_band["conversation_id"] and in_band["metadata"] is None
    assert in_band["audio"]["output"]["voice"] == "Chelsie" and out_of_band["audio"]["output"]["voice"] == "Ethan"
    spoken_done = spoken_reply[-1]["response"]
    assert spoken_done["status"] == "completed" and spoken_done["audio"]["output"]["voice"] == "Chelsie"
    assert spoken_done["output_modalities"] == ["audio"]
    assert any(e["type"] == "response.output_audio.delta" for e in spoken_reply)
    assert in_band["usage"]["input_tokens"] == out_of_band["usage"]["input_tokens"]
    assert after["usage"]["input_tokens"] > in_band["usage"]["input_tokens"]


@pytest.mark.slow
def test_speech_during_a_reply_interrupts_it_and_the_new_turn_is_answered(cluster):  # noqa: F811
    async def session():
        client, manager = _connect(cluster)
        async with client, manager as connection:
            await _until(connection, "session.created")
            # The spoken reply is interrupted; the new turn is answered in text. (A spoken reply after a
            # cancelled streamed one sometimes gets no audio at all, in about 1 of 10 fresh clusters: a
            # generate-stage issue reported apart, kept out of this module, whose last test this is.)
            await connection.session.update(session={"type": "realtime", "max_output_tokens": 6,
                                                     "output_modalities": ["text"], "audio": {
                "input": {"turn_detection": VAD}, "output": {"voice": "Chelsie"}}})
            await _until(connection, "session.updated")
            # The sampled reply may end early (the tiny model can sample its end token): then nothing was
            # running to interrupt, and the turn is tried again (at most 3 times).
            for _ in range(3):
                await connection.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "Talk for long."}]})
                await connection.response.create(response={"max_output_tokens": 400, "output_modalities": ["audio"]})
                first = await _until(connection, ("response.output_audio_transcript.delta", "response.done"))
                if first[-1]["type"] == "response.done":
                    continue
                await _append(connection, QUESTION + silence(0.7))   # the user speaks over the reply
                interrupted = await _until(connection, "response.done")
                answered = await _until(connection, "response.done")
                if "input_audio_buffer.speech_started" in [e["type"] for e in interrupted]:
                    return first, interrupted, answered
            pytest.fail("every reply ended before the user spoke")

    first, interrupted, answered = asyncio.run(session())
    running = next(e for e in first if e["type"] == "response.created")["response"]["id"]
    kinds = [e["type"] for e in interrupted]
    cancelled = interrupted[-1]["response"]
    assert cancelled["id"] == running and cancelled["status"] == "cancelled", kinds
    assert (cancelled["status_details"]["type"], cancelled["status_details"]["reason"]) == ("cancelled", "turn_detected")
    kinds = [e["type"] for e in answered]
    assert "input_audio_buffer.committed" in kinds and "response.created" in kinds
    assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
    assert answered[-1]["response"]["status"] == "completed" and answered[-1]["response"]["id"] != running
    assert "response.output_text.done" in kinds
