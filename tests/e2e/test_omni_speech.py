"""Speech out for Qwen2.5-Omni end to end: a real cluster (broker; prefill, decode and speech generate
workers; gateway, as separate processes) serving the tiny random Qwen2.5-Omni, driven through the
official ``openai`` client — chat with ``modalities=["text", "audio"]`` (whole and streamed) and
``POST /v1/audio/speech`` — with the audio compared to what transformers'
``Qwen2_5OmniForConditionalGeneration.generate`` speaks for the same prompt and seed.

Parity tolerance: the int16 samples of our WAV and of transformers' float waveform (quantised the
same way) differ by at most 1 LSB (1/32767 of full scale). The talker reads thinker hidden states
computed by our compact prefill/decode model, equal to transformers' up to float rounding (~1e-6),
which may move a sample across a rounding boundary; the codec tokens and the noise are identical.

The cluster runs the bundled ``deploy/pipelines/omni.yaml`` (encode → prefill → decode → generate);
text-only requests skip encode. transformers is called the documented way (``**processor(...)``:
with the prompt's attention mask).
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import time

import numpy as np
import openai
import pytest
import requests
import torch
from PIL import Image

from omnirelay.connectors.shared_memory import sweep_orphans
from omnirelay.handoffs import SpeechHandoff
from omnirelay.deploy.builders.omni import build_tiny_omni, load_full_model
from omnirelay.errors import BadRequest, TransferFailed
from omnirelay.speech_params import SpeechParams
from omnirelay.workers.speech.engine import SAMPLE_RATE, SpeechTask
from omnirelay.workers.speech.qwen2_5_omni import load_qwen2_5_omni
from omnirelay.workers.speech.role import encode_audio, flac_available

from media_fixtures import client_fixture
from media_support import pipeline_cluster, wav_samples
from omni_speech_support import settled_speech_stream_stats, speech_events, speech_stream_stats_after
from repo_paths import REPO_ROOT

# A cluster of five processes plus transformers' reference: one to three minutes on 2 shared cores.
pytestmark = pytest.mark.slow

MODEL = "tiny-omni"
MESSAGES = [{"role": "user", "content": "Say hello to the world"}]
MAX_TOKENS = 8           # thinker reply tokens
MAX_CODES = 16           # talker codec tokens: the random talker never says EOS, so this bounds the audio
SEED = 1234
PIPELINE = str(REPO_ROOT / "deploy" / "pipelines" / "omni.yaml")


@pytest.fixture(scope="module")
def tiny_omni(tmp_path_factory) -> str:
    return str(build_tiny_omni(tmp_path_factory.mktemp("models") / MODEL, seed=0))


@pytest.fixture(scope="module")
def prompt_ids(tiny_omni) -> list[int]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_omni)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _generate(model, ids: list[int], speaker: str = "Ethan", **media):
    """transformers' Qwen2.5-Omni generate as documented (inputs with their attention mask): greedy
    thinker, the talker's default sampling, seeded."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        sequences, wav = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        speaker=speaker, thinker_max_new_tokens=MAX_TOKENS, thinker_do_sample=False,
                                        talker_max_new_tokens=MAX_CODES, **media)
    return sequences[0, len(ids):].tolist(), wav.float()


@pytest.fixture(scope="module")
def reference(tiny_omni, prompt_ids):
    """The reference for MESSAGES, once per module."""
    torch.set_num_threads(1)
    model = load_full_model(tiny_omni).eval()
    reply, wav = _generate(model, prompt_ids)
    return {"reply": reply, "wav": wav, "model": model}


@pytest.fixture(scope="module")
def cluster(tiny_omni, tmp_path_factory):
    with pipeline_cluster(tiny_omni, str(tmp_path_factory.mktemp("omni-speech-logs")), MODEL, PIPELINE,
                          ("encode", "prefill", "decode", "generate"), start_timeout=180) as cluster:
        yield cluster


client = client_fixture(timeout=300)


def _wav_samples(data: bytes) -> np.ndarray:
    return wav_samples(data, SAMPLE_RATE)


def _int16(wav: torch.Tensor) -> np.ndarray:
    return (wav.clamp(-1, 1) * 32767).round().to(torch.int16).numpy()


def _chat_audio(client, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, modalities=["text", "audio"], max_tokens=MAX_TOKENS, temperature=0,
        seed=SEED, extra_body={"max_audio_tokens": MAX_CODES}, **kwargs)


# ------------------------------------------------------------------------------------ engine


def test_engine_matches_transformers_talker_and_token2wav(tiny_omni, prompt_ids, reference):
    """The speech engine alone, fed transformers' own thinker hidden states: the same waveform."""
    model = reference["model"]
    out = model.thinker.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 output_hidden_states=True, return_dict_in_generate=True)
    states = out.hidden_states
    engine = load_qwen2_5_omni(tiny_omni)
    assert engine.voices == ["Chelsie", "Ethan"]
    task = SpeechTask("r", prompt_ids, states[0][-1][0], out.sequences[0, len(prompt_ids):].tolist(),
                      torch.cat([s[-1][0] for s in states[1:]]), SpeechParams("Ethan", seed=SEED, max_codes=MAX_CODES),
                      time.time() + 60)
    wav, codes = engine.synthesize(task)
    engine.close()
    assert codes == MAX_CODES
    torch.testing.assert_close(wav, reference["wav"], rtol=0, atol=1e-6)
    assert wav.pow(2).mean().sqrt() > 0.01   # audible, not silence
    # Deterministic per seed, whatever ran before; another seed speaks differently.
    torch.testing.assert_close(engine.synthesize(task)[0], wav, rtol=0, atol=0)
    other = SpeechTask(**{**task.__dict__, "params": SpeechParams("Ethan", seed=SEED + 1, max_codes=MAX_CODES)})
    assert not torch.equal(engine.synthesize(other)[0], wav)


def test_engine_queue_cancel_and_deadline(tiny_omni, prompt_ids, reference):
    """step() starts requests on the synthesis threads up to max_batch_size: a request cancelled
    while it runs is dropped, a request past its deadline fails without running, the rest come out."""
    engine = load_qwen2_5_omni(tiny_omni, max_batch_size=1)
    try:
        hidden = engine.family.thinker_embed.shape[1]

        def task(request_id: str, deadline: float) -> SpeechTask:
            return SpeechTask(request_id, prompt_ids, torch.randn(len(prompt_ids), hidden), [5, 6, 7],
                              torch.randn(2, hidden), SpeechParams("Chelsie", seed=1, max_codes=4), deadline)

        with pytest.raises(BadRequest, match="voice 'alloy'"):
            engine.add(SpeechTask(**{**task("x", time.time() + 60).__dict__, "params": SpeechParams("alloy")}))
        for t in (task("a", time.time() + 60), task("b", time.time() + 60), task("late", time.time() - 1)):
            engine.add(t)
        outputs, failed = [], []
        first = engine.step(wait_s=0)
        failed += first.failed
        assert [r.request_id for r in engine.running] == ["a"]
        assert engine.cancel("a") and engine.num_requests == 2
        while engine.has_work:
            out = engine.step()
            outputs += out.outputs
            failed += out.failed
        assert [o.request_id for o in outputs] == ["b"] and outputs[0].num_codes == 4
        assert [(f.request_id, f.error_type) for f in failed] == [("late", "deadline_exceeded")]
    finally:
        engine.close()


def test_a_talker_waiting_for_its_thinker_holds_back_no_other_request(tiny_omni, prompt_ids, tmp_path):
    """Request a's reply is streamed and its first chunk never comes; b's reply is whole. b is spoken
    while a waits (a gives its turn up while it waits for the thinker), then a is cancelled."""
    from omnirelay.connectors import create_connector
    from omnirelay.handoffs import ChunkStream
    from omnirelay.workers.speech.reply_source import ReplySource

    connector = create_connector("shared_memory", {"shm_dir": str(tmp_path)})
    engine = load_qwen2_5_omni(tiny_omni, max_batch_size=2)
    try:
        hidden = engine.family.thinker_embed.shape[1]
        params = SpeechParams("Chelsie", seed=1, max_codes=4)
        waiting = ReplySource.streamed(ChunkStream("speech/a/0/reply", max_chunks=4, window=2), connector,
                                       timeout_s=120, deadline=time.time() + 120)
        engine.add(SpeechTask("a", prompt_ids, torch.randn(len(prompt_ids), hidden), [], torch.zeros(0, 0), params,
                              time.time() + 120, reply_stream=waiting))
        engine.add(SpeechTask("b", prompt_ids, torch.randn(len(prompt_ids), hidden), [5, 6, 7],
                              torch.randn(2, hidden), params, time.time() + 120))
        outputs, failed = [], []
        for _ in range(2000):   # b is done in well under a second of steps; a's wait is two minutes
            out = engine.step()
            outputs += out.outputs
            failed += out.failed
            if outputs:
                break
        assert [o.request_id for o in outputs] == ["b"] and not failed and "a" in engine.requests
        assert engine.cancel("a")
        for _ in range(2000):
            if not engine.has_work:
                break
            failed += engine.step().failed
        assert not engine.has_work and not failed
    finally:
        engine.close()
        connector.close()


def test_engine_streams_pieces_while_the_talker_speaks(tiny_omni, prompt_ids):
    """A streamed request: pieces in order, the first emitted after 24 codes (one token2wav block
    and its look-ahead) of 72, concatenating to the one-shot's length, audible, the same on a second
    run; cancelled after its first piece it stops there; a failure mid-stream comes after the
    pieces already out."""
    engine = load_qwen2_5_omni(tiny_omni)
    try:
        hidden = engine.family.thinker_embed.shape[1]
        g = torch.Generator().manual_seed(3)
        task = SpeechTask("s", prompt_ids, torch.randn(len(prompt_ids), hidden, generator=g), [5, 6, 7, 8],
                          torch.randn(3, hidden, generator=g), SpeechParams("Ethan", seed=SEED, max_codes=72),
                          time.time() + 600, stream=True)
        pieces = []
        assert engine.synthesize_stream(task, pieces.append) == 72
        assert [(c.index, c.codes, c.final) for c in pieces] == [(0, 24, False), (1, 72, False), (2, 72, True)]
        wav = torch.cat([c.waveform for c in pieces])
        one_shot, codes = engine.synthesize(task)
        assert codes == 72 and wav.shape == one_shot.shape == (72 * 480,)
        assert wav.pow(2).mean().sqrt() > 0.01
        again = []
        engine.synthesize_stream(task, again.append)
        assert all(torch.equal(a.waveform, b.waveform) for a, b in zip(pieces, again))

        # Through step(): cancel once the first piece is out; the synthesis stops at the next token.
        engine.add(task)
        got = []
        while not got:
            got += engine.step().chunks
        assert engine.cancel("s")
        while engine.has_work:
            step = engine.step()
            got += step.chunks
            assert not step.outputs and not step.failed
        assert [c.index for c in got] == [0]

        # A failure inside token2wav after the first piece: that piece, then the failure.
        vocoder = engine.family.token2wav.code2wav_bigvgan_model
        calls = []

        def failing(mel):
            calls.append(mel.shape[2])
            if len(calls) > 1:
                raise RuntimeError("vocoder broke")
            return type(vocoder).forward(vocoder, mel)

        vocoder.forward = failing
        engine.add(task)
        chunks, failed = [], []
        while engine.has_work:
            step = engine.step()
            chunks += step.chunks
            failed += step.failed
        del vocoder.forward
        assert [c.index for c in chunks] == [0]
        assert [(f.request_id, f.error_type) for f in failed] == [("s", "internal_error")]
        assert "vocoder broke" in failed[0].message
    finally:
        engine.close()


def test_role_reads_the_states_and_sends_the_audio_in_chunks(tiny_omni, prompt_ids):
    """The speech role on its own (no processes): hidden states in through a shared-memory connector,
    MediaResults out in index order, the last with ``finish``, then StageDone; the keys are gone after.
    A voice the model lacks is a StageFailed(bad_request) that also frees the keys."""
    from omnirelay.broker import protocol as p
    from omnirelay.connectors import create_connector
    from omnirelay.request_params import TextParams
    from omnirelay.workers.speech.role import WAV_STREAM_HEADER, GenerateSpeechRole

    connector = create_connector("shared_memory", {})
    engine = load_qwen2_5_omni(tiny_omni)
    try:
        role = GenerateSpeechRole("w", engine, connector, chunk_bytes=1000)
        hidden = engine.family.thinker_embed.shape[1]

        def task(request_id: str, voice: str, params: SpeechParams | None = None) -> p.Task:
            stored = {}
            for name, payload in (("prompt", {"hidden": torch.randn(len(prompt_ids), hidden)}),
                                  ("reply", {"hidden": torch.randn(2, hidden), "token_ids": [5, 6, 7]})):
                key = f"speech/{request_id}/{name}"
                stored[name] = key, connector.put(key, payload)
            inputs = SpeechHandoff(*stored["prompt"], *stored["reply"])
            speech = params or SpeechParams(voice, format="pcm", seed=3, max_codes=4)
            return p.Task(request_id=request_id, stage="generate", model=MODEL, prompt_token_ids=prompt_ids,
                          params=TextParams(speech=speech), inputs=inputs, reply_to="tcp://127.0.0.1:1",
                          deadline=time.time() + 60)

        bad = task("bad", "alloy")
        [(dest, failed)] = role.accept(bad)
        assert isinstance(failed, p.StageFailed) and failed.error_type == "bad_request" and "alloy" in failed.message
        good = task("good", "Ethan")
        assert role.accept(good) == []
        out = []
        while engine.has_work:
            out += role.step()
        media = [m for _, m in out if isinstance(m, p.MediaResult)]
        assert [m.index for m in media] == list(range(len(media))) and len(media) == 4 * 960 // 1000 + 1
        assert [m.finish for m in media] == [False] * (len(media) - 1) + [True]
        pcm = b"".join(base64.b64decode(m.data) for m in media)
        assert len(pcm) == 4 * 960 and all(m.mime == "audio/pcm" for m in media)
        assert isinstance(out[-1][1], p.StageDone) and out[-1][1].finished
        for t in (bad, good):
            for name in ("prompt", "reply"):
                with pytest.raises(TransferFailed):
                    connector.get(getattr(t.inputs, f"speech_{name}_key"), timeout=0.2)
        assert len(role.deliveries) == 0   # the role's records of both went with them

        # Streamed (SpeechParams.stream): the pieces go out as MediaResults numbered on across
        # pieces, the WAV header (unknown length) first, finish on the very last, then StageDone.
        streamed = task("streamed", "Ethan", SpeechParams("Ethan", format="wav", seed=3, max_codes=30,
                                                                stream=True))
        assert role.accept(streamed) == []
        out = []
        while engine.has_work:
            out += role.step()
        media = [m for _, m in out if isinstance(m, p.MediaResult)]
        data = b"".join(base64.b64decode(m.data) for m in media)
        assert [m.index for m in media] == list(range(len(media))) and media[-1].finish
        assert sum(m.finish for m in media) == 1 and data[:44] == WAV_STREAM_HEADER
        assert _wav_samples(data).shape == (30 * 480,)
        assert isinstance(out[-1][1], p.StageDone) and out[-1][1].finished
        assert len(role.deliveries) == 0
    finally:
        engine.close()
        connector.close()


def test_encodings_round_trip():
    wav = torch.sin(torch.linspace(0, 200, SAMPLE_RATE // 10)) * 0.5
    samples = _wav_samples(encode_audio(wav, "wav"))
    assert np.array_equal(samples, np.frombuffer(encode_audio(wav, "pcm"), dtype="<i2"))
    assert np.abs(samples / 32767 - wav.numpy()).max() <= 0.5 / 32767 + 1e-7


# ------------------------------------------------------------------------------------ chat with audio out


def test_chat_audio_matches_transformers(client, reference, tiny_omni):
    resp = _chat_audio(client, audio={"voice": "Ethan", "format": "wav"})
    message = resp.choices[0].message
    audio = message.audio
    assert audio is not None and audio.id and audio.expires_at > time.time()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_omni)
    assert audio.transcript == tok.decode(reference["reply"], skip_special_tokens=True)
    assert resp.usage.completion_tokens == len(reference["reply"])
    samples = _wav_samples(base64.b64decode(audio.data))
    expected = _int16(reference["wav"])
    assert samples.shape == expected.shape == (MAX_CODES * 480,)   # 2 mel frames per code, 240 samples each
    assert np.sqrt(np.mean((samples / 32767.0) ** 2)) > 0.01          # not silent
    assert np.abs(samples.astype(np.int32) - expected.astype(np.int32)).max() <= 1


def test_chat_with_an_image_in_and_audio_out_matches_transformers(client, reference, tiny_omni):
    """The design's flagship request: encode → prefill → decode → generate. The talker's positions
    follow the image's M-RoPE grid, as in transformers."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    pixels = (np.random.RandomState(5).rand(64, 80, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    png = buf.getvalue()
    tok = AutoTokenizer.from_pretrained(tiny_omni)
    processor = Qwen2VLImageProcessorPil.from_pretrained(tiny_omni)
    content = [{"type": "text", "text": "What is in this picture?"}, {"type": "image"}]
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    image = processor(images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt")
    n = int(image["image_grid_thw"][0].prod()) // processor.merge_size ** 2
    ids = list(tok(text.replace(tok.image_token, tok.image_token * n), add_special_tokens=False)["input_ids"])
    # pixel_values go to the thinker only (its ``thinker_`` prefix): un-prefixed, transformers 5.24's
    # generate() also hands them to the talker's generate(), which rejects them as unused. The grid
    # goes to both, as the talker's M-RoPE needs it.
    reply, wav = _generate(reference["model"], ids, speaker="Chelsie", thinker_pixel_values=image["pixel_values"],
                           image_grid_thw=image["image_grid_thw"])

    url = "data:image/png;base64," + base64.b64encode(png).decode()
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                                            {"type": "image_url", "image_url": {"url": url}}]}],
        modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"}, max_tokens=MAX_TOKENS,
        temperature=0, seed=SEED, extra_body={"max_audio_tokens": MAX_CODES})
    audio = resp.choices[0].message.audio
    assert resp.usage.prompt_tokens == len(ids)
    assert audio.transcript == tok.decode(reply, skip_special_tokens=True)
    samples = _wav_samples(base64.b64decode(audio.data))
    expected = _int16(wav)
    assert samples.shape == expected.shape
    assert np.abs(samples.astype(np.int32) - expected.astype(np.int32)).max() <= 1


def _stream_chat_audio(client, fmt: str, codes: int) -> tuple[list[bytes], str, str | None, int]:
    """A streamed chat with audio: the audio chunks' bytes, the transcript, finish reason and usage."""
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, modalities=["text", "audio"], max_tokens=MAX_TOKENS, temperature=0,
        seed=SEED, audio={"voice": "Ethan", "format": fmt}, stream=True, stream_options={"include_usage": True},
        extra_body={"max_audio_tokens": codes})
    chunks, transcript, finish, usage = [], [], None, None
    for event in stream:
        usage = event.usage or usage
        if not event.choices:
            continue
        audio = event.choices[0].delta.audio   # the client's typed streamed-audio delta
        if audio is not None and audio.data:
            chunks.append(base64.b64decode(audio.data))
        if audio is not None and audio.transcript:
            transcript.append(audio.transcript)
        finish = event.choices[0].finish_reason or finish
    return chunks, "".join(transcript), finish, usage.completion_tokens


STREAM_CODES = 72   # six token2wav blocks: a first piece after 24 codes, then 4 blocks, then the last


def test_chat_audio_stream_is_synthesised_while_the_talker_speaks(client, cluster):
    """A streamed chat's audio comes from incremental synthesis: the chunks concatenate to a WAV
    (header of unknown length) as long as the one-shot's and audible; its first piece left the
    worker when the talker had produced fewer codes than it finally did (the worker's counters);
    the same seed streams the same bytes; PCM streams the same samples without the header."""
    whole = base64.b64decode(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, modalities=["text", "audio"], max_tokens=MAX_TOKENS, temperature=0,
        seed=SEED, audio={"voice": "Ethan", "format": "wav"},
        extra_body={"max_audio_tokens": STREAM_CODES}).choices[0].message.audio.data)
    before = settled_speech_stream_stats(cluster)
    chunks, transcript, finish, completion_tokens = _stream_chat_audio(client, "wav", STREAM_CODES)
    assert len(chunks) > 1 and transcript and finish == "length" and completion_tokens == MAX_TOKENS
    streamed = b"".join(chunks)
    samples = _wav_samples(streamed)
    assert samples.shape == _wav_samples(whole).shape == (STREAM_CODES * 480,)   # same codes: same duration
    assert np.sqrt(np.mean((samples / 32767.0) ** 2)) > 0.01
    again, *_ = _stream_chat_audio(client, "wav", STREAM_CODES)
    assert b"".join(again) == streamed                                            # deterministic per seed
    pcm, *_ = _stream_chat_audio(client, "pcm16", STREAM_CODES)
    assert b"".join(pcm) == streamed[44:]
    delta = speech_stream_stats_after(cluster, before, requests=3)
    assert delta["speech_stream_early_first_chunks"] == 3
    assert delta["speech_stream_first_chunk_codes"] == 3 * 24 and delta["speech_stream_codes"] == 3 * STREAM_CODES
    assert delta["speech_stream_chunks"] == 3 * 3


# ------------------------------------------------------------------------------------ /v1/audio/speech


def test_speech_endpoint_wav_and_pcm(client):
    kwargs = dict(model=MODEL, voice="Chelsie", input="Hello there, world.", extra_body={"seed": 7, "max_audio_tokens": 12})
    wav = client.audio.speech.create(response_format="wav", **kwargs)
    samples = _wav_samples(wav.content)
    assert samples.shape == (12 * 480,) and np.sqrt(np.mean((samples / 32767.0) ** 2)) > 0.01
    pcm = client.audio.speech.create(response_format="pcm", **kwargs)
    assert np.array_equal(np.frombuffer(pcm.content, dtype="<i2"), samples)   # same seed: the same speech
    faster = client.audio.speech.create(response_format="pcm", speed=2.0, **kwargs)
    assert len(faster.content) // 2 == len(samples) // 2


def test_speech_endpoint_streams_the_file_as_it_is_synthesised(client, cluster):
    """``stream_format="audio"``: the body arrives in pieces from incremental synthesis — a WAV of
    the one-shot's length, audible, the same bytes for the same seed; the worker's first piece
    left before the talker's last code. Without ``stream_format`` the answer stays the one-shot's."""
    kwargs = dict(model=MODEL, voice="Chelsie", input="Hello there, world.",
                  extra_body={"seed": 7, "max_audio_tokens": STREAM_CODES})
    whole = client.audio.speech.create(response_format="wav", **kwargs).content
    before = settled_speech_stream_stats(cluster)
    bodies = []
    for _ in range(2):
        with client.audio.speech.with_streaming_response.create(response_format="wav", stream_format="audio",
                                                                 **kwargs) as response:
            assert response.headers["content-type"] == "audio/wav"
            bodies.append([part for part in response.iter_bytes() if part])
    streamed = b"".join(bodies[0])
    assert b"".join(bodies[1]) == streamed and len(bodies[0]) > 1
    samples = _wav_samples(streamed)
    assert samples.shape == _wav_samples(whole).shape == (STREAM_CODES * 480,)
    assert np.sqrt(np.mean((samples / 32767.0) ** 2)) > 0.01
    assert speech_stream_stats_after(cluster, before, requests=2)["speech_stream_early_first_chunks"] == 2
    with pytest.raises(openai.UnprocessableEntityError, match="'chunks' is not supported"):
        client.audio.speech.create(response_format="wav", stream_format="chunks", **kwargs)


def _speech_input_tokens(tiny_omni: str, text: str) -> int:
    """The speech prompt: one user turn and the assistant header, then the text and <|im_end|>."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_omni)
    template = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return sum(len(tok(part, add_special_tokens=False)["input_ids"]) for part in (template, text)) + 1


def test_speech_sse_events_carry_the_audio_stream_and_usage(client, cluster, tiny_omni):
    """``stream_format="sse"``: speech.audio.delta events from the same incremental synthesis as
    ``stream_format="audio"`` — their audio concatenates to that body, byte for byte, in several
    deltas — then speech.audio.done whose output_tokens is the talker's codec count as the worker
    itself counted it, and whose input_tokens is the speech prompt's."""
    text = "Hello there, world."
    kwargs = dict(model=MODEL, voice="Chelsie", input=text, response_format="wav",
                  extra_body={"seed": 7, "max_audio_tokens": STREAM_CODES})
    with client.audio.speech.with_streaming_response.create(stream_format="audio", **kwargs) as response:
        body = response.read()
    before = settled_speech_stream_stats(cluster)
    deltas, done = speech_events(client, **kwargs)
    assert len(deltas) >= 2 and b"".join(deltas) == body
    assert deltas[0][:4] == b"RIFF" and deltas[0][4:8] == b"\xff\xff\xff\xff"   # the streamed header, as "audio"
    codes = speech_stream_stats_after(cluster, before, requests=1)["speech_stream_codes"]
    assert codes == STREAM_CODES   # the random talker never says EOS: it speaks its whole budget
    inputs = _speech_input_tokens(tiny_omni, text)
    assert done["usage"] == {"input_tokens": inputs, "output_tokens": codes, "total_tokens": inputs + codes}


def test_speech_sse_pcm_is_the_raw_samples(client):
    """PCM deltas are raw 16-bit samples from the first byte: the streamed WAV without its header."""
    kwargs = dict(model=MODEL, voice="Chelsie", input="Hello there, world.",
                  extra_body={"seed": 7, "max_audio_tokens": STREAM_CODES})
    with client.audio.speech.with_streaming_response.create(stream_format="audio", response_format="wav",
                                                             **kwargs) as response:
        wav = response.read()
    deltas, done = speech_events(client, response_format="pcm", **kwargs)
    assert len(deltas) >= 2 and b"".join(deltas) == wav[44:]
    assert done["usage"]["output_tokens"] == STREAM_CODES


def test_speech_sse_bad_voice_is_a_json_400_before_any_event(client, cluster):
    with pytest.raises(openai.BadRequestError, match="voice 'alloy' is not available"):
        speech_events(client, model=MODEL, voice="alloy", input="hi", response_format="wav")
    r = requests.post(cluster.url + "/v1/audio/speech", timeout=30,
                      json={"model": MODEL, "voice": "alloy", "input": "hi", "stream_format": "sse"})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == "voice" and {"request_id", "stage"} <= set(r.json())


def test_bad_voice_and_format_are_400(client, cluster):
    with pytest.raises(openai.BadRequestError, match="voice 'alloy' is not available.*Chelsie, Ethan"):
        client.audio.speech.create(model=MODEL, voice="alloy", input="hi", response_format="wav")
    with pytest.raises(openai.BadRequestError, match="'mp3' is not supported.*wav"):
        client.audio.speech.create(model=MODEL, voice="Ethan", input="hi", response_format="mp3")
    with pytest.raises(openai.BadRequestError, match="voice 'nova'"):
        _chat_audio(client, audio={"voice": "nova", "format": "wav"})
    with pytest.raises(openai.BadRequestError, match="audio.format 'mp3'"):
        _chat_audio(client, audio={"voice": "Ethan", "format": "mp3"})
    r = requests.post(cluster.url + "/v1/audio/speech", json={"model": MODEL, "voice": "Ethan", "input": ""}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_speech_endpoint_flac_when_soundfile_is_installed(client):
    """FLAC rides on the optional ``soundfile`` package: lossless (the WAV's samples) when this
    environment has it, else a 400 that says why."""
    kwargs = dict(model=MODEL, voice="Chelsie", input="Hello there, world.", extra_body={"seed": 7, "max_audio_tokens": 12})
    try:
        import soundfile
    except (ImportError, OSError):
        with pytest.raises(openai.BadRequestError, match="'flac' needs the soundfile package"):
            client.audio.speech.create(response_format="flac", **kwargs)
        return
    flac = client.audio.speech.create(response_format="flac", **kwargs)
    samples, rate = soundfile.read(io.BytesIO(flac.content), dtype="int16")
    assert rate == SAMPLE_RATE and flac.content[:4] == b"fLaC"
    wav = client.audio.speech.create(response_format="wav", **kwargs)
    assert np.array_equal(samples, _wav_samples(wav.content))


def test_speech_sse_flac_comes_whole_at_the_end(client):
    """FLAC is not synthesised incrementally (its header wants the length): with ``sse`` its bytes
    are the one-shot file, sent once the utterance is done; usage reads the length from its header."""
    if not flac_available():
        pytest.skip("no soundfile here: flac is a 400 (test_speech_endpoint_flac_when_soundfile_is_installed)")
    kwargs = dict(model=MODEL, voice="Chelsie", input="Hello there, world.", response_format="flac",
                  extra_body={"seed": 7, "max_audio_tokens": 12})
    deltas, done = speech_events(client, **kwargs)
    assert b"".join(deltas) == client.audio.speech.create(**kwargs).content
    assert done["usage"]["output_tokens"] == 12


def test_a_one_token_reply_is_answered_as_text_without_audio(client, reference):
    """The talker needs the states of two reply tokens; a reply that ends at its first token (here a
    stop token) comes back at once as text, not after the deadline."""
    started = time.monotonic()
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"},
        max_tokens=MAX_TOKENS, temperature=0, extra_body={"stop_token_ids": [reference["reply"][0]]})
    assert resp.choices[0].message.audio is None and resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == 1 and time.monotonic() - started < 30


def test_kill9_of_the_speaking_worker_still_answers_with_the_same_audio(cluster, client):
    """A generate worker killed mid-synthesis: the broker sees it miss heartbeats. Its talker read the
    thinker's reply as decode streamed it (chunks deleted once read), so the stage cannot be replayed
    alone: the request fails as resumable and the gateway submits it again, skipping what the client
    has; from the same seed the other worker speaks the very same audio."""
    cluster.start_worker("generate", "--stage-configs-path", PIPELINE)
    deadline = time.monotonic() + 120
    while sum(w["role"] == "generate" for w in cluster.workers()) < 2:
        assert time.monotonic() < deadline, "the second generate worker did not register"
        time.sleep(0.2)

    def ask():
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES, modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"},
            max_tokens=MAX_TOKENS, temperature=0, seed=SEED + 7, extra_body={"max_audio_tokens": 96})

    baseline = ask().choices[0].message.audio.data
    def healed() -> int:   # a stage replayed by the broker, or the request resubmitted by the gateway
        broker = requests.get(cluster.url + "/cluster", timeout=10).json()["broker"]
        return broker.get("stage_retries", 0) + broker.get("failed:worker_lost", 0)

    before = healed()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(ask)
        victim = None
        while victim is None and not answer.done():
            busy = [w for w in cluster.workers() if w["role"] == "generate" and w["assigned"]]   # the broker's view
            victim = next((proc for proc in cluster.procs if busy and proc.pid == busy[0]["pid"]), None)
            time.sleep(0.1)
        assert victim is not None, "the request finished before the broker dispatched its generate stage"
        victim.kill9()
        resp = answer.result(timeout=300)
    sweep_orphans(owners={victim.pid})   # what a crash leaves in /dev/shm (omni-serve sweeps the same way)
    assert resp.choices[0].message.audio.data == baseline
    retried = healed() - before
    assert retried >= 1 and "missed heartbeats; dropping it" in "".join(p.output() for p in cluster.procs)
