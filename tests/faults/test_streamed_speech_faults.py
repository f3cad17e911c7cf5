"""Faults in the middle of a spoken answer whose stages stream into each other (issue #25): decode
streams the reply to generate while it writes it, so when first audio reaches the client both stages
are running. Killed (kill -9) or paused (SIGSTOP past the broker's liveness) mid-answer, either
worker's request is failed as resumable by the broker and submitted again by the gateway, which
skips the tokens and audio chunks the client already has: the answer completes once, with exactly
the text and audio of an undisturbed run (same seed). A client that leaves mid-answer leaves no
connector key behind.

Real processes: broker, prefill, two decode and two generate workers of the tiny Qwen2.5-Omni,
and a gateway, with the bundled pipeline on a shared-memory directory of this test's own.
"""

from __future__ import annotations

import base64
import os
import pathlib
import threading
import time

import openai
import pytest
import yaml

from omnirelay.connectors.shared_memory import sweep_orphans
from omnirelay.deploy.builders.omni import build_tiny_omni

from cluster import Cluster, pause_process, settled_workers
from repo_paths import REPO_ROOT

pytestmark = pytest.mark.slow

MODEL = "tiny-omni"
MESSAGES = [{"role": "user", "content": "Tell me a story about the sea."}]
REPLY_TOKENS = 160       # decode is killed while it writes them, generate once its first audio is out
KILL_DECODE_AFTER = 4    # transcript deltas: the talker started (after 4 tokens), decode is far from done
AUDIO_CODES = 96
PAUSE_S = 6.0            # longer than the broker's liveness
PIPELINE = REPO_ROOT / "deploy" / "pipelines" / "omni.yaml"


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("shm-keys")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, keys_dir):
    model = str(build_tiny_omni(tmp_path_factory.mktemp("models") / MODEL, seed=0))
    spec = yaml.safe_load(PIPELINE.read_text())
    spec["connectors"]["data"]["options"]["shm_dir"] = str(keys_dir)   # this test's keys only
    pipeline = tmp_path_factory.mktemp("pipeline") / "omni.yaml"
    pipeline.write_text(yaml.safe_dump(spec))
    stages = ("--stage-configs-path", str(pipeline))
    c = Cluster(model, str(tmp_path_factory.mktemp("streamed-speech-logs")), model_name=MODEL)
    try:
        c.start_broker()
        for role in ("encode", "prefill", "decode", "decode", "generate", "generate"):
            c.start_worker(role, *stages)
        c.start_gateway(*stages)
        c.wait_healthy(timeout=240)
        c.wait_for_workers(6, timeout=240)
        c.stage_args = stages
        yield c
    finally:
        c.stop()


def spoken(cluster: Cluster, seed: int, on_first_audio=None, leave_after_first_audio: bool = False,
           on_text=None):
    """One streamed spoken chat: (its transcript, the audio's bytes, the finish reason, completion
    tokens). ``on_first_audio()`` runs (in a thread) once the first audio chunk is in, ``on_text()``
    once :data:`KILL_DECODE_AFTER` transcript deltas are, while the answer goes on."""
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, modalities=["text", "audio"], audio={"voice": "Ethan", "format": "pcm16"},
        max_tokens=REPLY_TOKENS, temperature=0, seed=seed, stream=True, stream_options={"include_usage": True},
        extra_body={"max_audio_tokens": AUDIO_CODES, "ignore_eos": True})
    transcript, audio, finish, usage, fault = [], b"", None, None, None
    try:
        for event in stream:
            usage = event.usage or usage
            if not event.choices:
                continue
            finish = event.choices[0].finish_reason or finish
            piece = event.choices[0].delta.audio   # the client's typed streamed-audio delta
            if piece is not None and piece.transcript:
                transcript.append(piece.transcript)
                if on_text is not None and fault is None and len(transcript) >= KILL_DECODE_AFTER:
                    fault = threading.Thread(target=on_text)
                    fault.start()
            if piece is not None and piece.data:
                audio += base64.b64decode(piece.data)
                if leave_after_first_audio:
                    return "".join(transcript), audio, finish, None
                if on_first_audio is not None and fault is None:
                    fault = threading.Thread(target=on_first_audio)
                    fault.start()
    finally:
        stream.close()
        if fault is not None:
            fault.join(60)
    return "".join(transcript), audio, finish, usage.completion_tokens if usage else None


def busy(cluster: Cluster, role: str):
    """The process of the ``role`` worker the broker has a task on (the request in flight)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = [w["pid"] for w in cluster.workers() if w["role"] == role and w["assigned"]]
        procs = [p for p in cluster.procs if pids and p.pid == pids[0] and p.alive()]
        if procs:
            return procs[0]
        time.sleep(0.05)
    raise AssertionError(f"no {role} worker holds the request")


@pytest.fixture(scope="module")
def baseline(cluster):
    transcript, audio, finish, completion = spoken(cluster, seed=5)
    assert transcript and completion == REPLY_TOKENS and finish == "length"
    assert len(audio) == AUDIO_CODES * 480 * 2   # 480 samples per code, 16 bits each
    return transcript, audio


def test_the_stages_overlap_and_the_answer_is_deterministic(cluster, baseline, keys_dir):
    """Decode announced streamed hand-offs (generate started on their first chunk), and the same
    seed gives the same answer again. (That a streamed hand-off speaks exactly what a whole one does
    is test_omni_speech.py's and test_qwen3_omni.py's parity with transformers, which runs the talker
    after the thinker, and test_reply_stream.py's chunks.)"""
    workers = settled_workers(cluster.url)
    assert sum(w["stats"].get("speech_streams", 0) for w in workers if w["role"] == "decode") >= 1
    assert spoken(cluster, seed=5)[:2] == baseline
    no_key_left(cluster, keys_dir)


@pytest.mark.parametrize("role", ["decode", "generate"])
def test_kill9_mid_answer_completes_it_once(cluster, baseline, keys_dir, role):
    victims = []

    def kill():
        victim = busy(cluster, role)
        victims.append(victim)
        victim.kill9()

    # Decode while it writes the reply (the talker already reads it), generate while it speaks.
    when = {"on_text": kill} if role == "decode" else {"on_first_audio": kill}
    transcript, audio, finish, completion = spoken(cluster, seed=5, **when)
    assert victims and not victims[0].alive()
    assert (transcript, audio) == baseline and finish == "length"   # nothing missing, nothing twice
    assert completion == REPLY_TOKENS
    sweep_orphans(str(keys_dir), owners={victims[0].pid})       # what a crash leaves (omni-serve sweeps so too)
    cluster.start_worker(role, *cluster.stage_args)                 # back to two of each
    cluster.wait_for_workers(6, timeout=240)


def test_a_paused_generate_worker_mid_answer_completes_it_once(cluster, baseline):
    paused = []

    def stop_and_go():
        victim = busy(cluster, "generate")
        paused.append(victim)
        pause_process(victim.pid, PAUSE_S)

    transcript, audio, finish, completion = spoken(cluster, seed=5, on_first_audio=stop_and_go)
    assert paused and paused[0].alive()
    assert (transcript, audio) == baseline and finish == "length" and completion == REPLY_TOKENS


def no_key_left(cluster, keys_dir):
    """Once the workers hold nothing: no connector key left. (Checked after the undisturbed answers
    and the client that leaves; after a kill -9 of decode, one CI run once found a single small
    chunk of the resubmitted answer left for its TTL, not reproduced since: an open finding.)"""
    settled_workers(cluster.url)
    # Deletes run on the workers' transfer threads, after the reports that settle them: the keys
    # are the store's own state (no heartbeat), asked again, bounded, until they are gone.
    deadline = time.monotonic() + 10
    while (left := {name: os.readlink(keys_dir / name) for name in os.listdir(keys_dir)
                    if os.path.islink(keys_dir / name)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    owners = {int(target.split("-")[1]) for target in left.values() if target.split("-")[1].isdigit()}
    assert left == {}, [(proc.name, proc.pid) for proc in cluster.procs if proc.pid in owners]


def test_a_client_leaving_mid_answer_leaves_no_key(cluster, keys_dir):
    for name in os.listdir(keys_dir):   # what the fault tests may have left is not this test's
        if os.path.islink(keys_dir / name):
            os.unlink(keys_dir / name)
    _, audio, _, _ = spoken(cluster, seed=9, leave_after_first_audio=True)
    assert audio
    no_key_left(cluster, keys_dir)   # the cancel reached both stages and they deleted what they held

