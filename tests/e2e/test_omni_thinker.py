"""Qwen2.5-Omni thinker end to end: image + audio in, text out, through encode → prefill → decode.

A real ``omni-serve`` on the tiny random-weight omni model (``omni-make-model tiny-omni``) with
``deploy/pipelines/omni_thinker.yaml``; requests through the official ``openai`` client. The
reference is transformers' ``Qwen2_5OmniThinkerForConditionalGeneration.generate`` on the same
directory, with its inputs built by transformers' own preprocessors (Qwen2-VL image processor,
Whisper features) and its own token-count rules -- so the gateway's placeholder expansion, the
encode worker's encoders, the prefill's embedding merge and M-RoPE, and decode's rope delta must
all agree with transformers for the greedy tokens to match.
"""

from __future__ import annotations

import base64
import os
import urllib.request

import numpy as np
import openai
import pytest

from omnirelay.deploy.builders.omni import build_tiny_omni

from cluster import settled_workers
from conftest import ServeProcess
from media_support import audio_part, image_part, random_png, thinker_reference, wav_bytes
from omni_engine_support import decode_prefilled, encode_then_prefill
from repo_paths import REPO_ROOT

PIPELINE = os.path.join(REPO_ROOT, "deploy", "pipelines", "omni_thinker.yaml")
MAX_TOKENS = 12


def _png(seed: int, size=(80, 64)) -> bytes:
    return random_png(seed, size)


def _tone(freq: float, seconds: float = 1.0) -> np.ndarray:
    """A 16 kHz clip, already on the int16 grid so WAV round-trips it exactly."""
    pcm = np.round(0.5 * np.sin(np.arange(int(16000 * seconds)) * 2 * np.pi * freq / 16000) * 32767)
    return pcm.astype("<i2")


@pytest.fixture(scope="module")
def tiny_omni(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny-omni"
    build_tiny_omni(path, seed=0)
    return str(path)


@pytest.fixture(scope="module")
def hf(tiny_omni):
    """transformers' greedy thinker on (text before, image, audio, text after) chat messages."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths

    return thinker_reference(tiny_omni, Qwen2_5OmniThinkerForConditionalGeneration, _get_feat_extract_output_lengths,
                             MAX_TOKENS)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> str:
    """The directory the server lets image_url name files in (--allowed-local-media-path)."""
    return str(tmp_path_factory.mktemp("media"))


@pytest.fixture(scope="module")
def server(tiny_omni, media_dir, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("serve-omni") / "omni-serve.log")
    serve = ServeProcess(tiny_omni, "--served-model-name", "tiny-omni", "--stage-configs-path", PIPELINE,
                         "--allowed-local-media-path", media_dir, "--log-level", "WARNING", log_path=log_path)
    yield serve
    serve.stop()


def _chat(client, content, **kwargs):
    return client.chat.completions.create(model="tiny-omni", messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True},
                                          **kwargs)


def _encode_stats(server) -> dict:
    """The encode worker's engine counters once every answered request is counted in them (they
    travel in heartbeats: :func:`settled_workers` waits for the cluster to say they are final)."""
    workers = settled_workers(server.url)
    stats = [w["stats"] for w in workers if w["role"] == "encode"]
    assert len(stats) == 1, workers
    return stats[0]


def test_image_and_audio_in_text_out_equals_transformers(client, server, hf):
    png, pcm = _png(0), _tone(440.0)
    content = [{"type": "text", "text": "Look:"}, image_part(png), audio_part(wav_bytes(pcm)),
               {"type": "text", "text": "what do you see and hear?"}]
    before = _encode_stats(server).get("encoded_requests", 0)
    reply = _chat(client, content)
    expected = hf(content, png=png, pcm=pcm)
    assert len(set(expected)) > 3, "the reference itself is degenerate"
    assert reply.choices[0].token_ids == expected
    # The media went through the encode worker (its engine counted the request) ...
    assert _encode_stats(server).get("encoded_requests", 0) == before + 1
    # ... and the answer depends on it: another picture gives another reply.
    other = _chat(client, [content[0], image_part(_png(1)), *content[2:]])
    assert other.choices[0].token_ids == hf(content, png=_png(1), pcm=pcm)
    assert other.choices[0].token_ids != expected


def test_audio_only_and_text_only_match_and_repeats_hit_the_encoder_cache(client, server, hf):
    pcm = _tone(880.0, 0.7)
    content = [audio_part(wav_bytes(pcm)), {"type": "text", "text": "Listen."}]
    before = _encode_stats(server).get("encoded_requests", 0)
    assert _chat(client, content).choices[0].token_ids == hf(content, pcm=pcm)
    stats = _encode_stats(server)
    served, hits = stats.get("encoded_requests", 0), stats.get("encoder_cache_hits", 0)
    assert served == before + 1
    assert _chat(client, content).choices[0].token_ids == hf(content, pcm=pcm)
    stats = _encode_stats(server)
    assert stats.get("encoded_requests", 0) == served + 1 and stats["encoder_cache_hits"] == hits + 1
    text = [{"type": "text", "text": "What is the weather like today?"}]
    assert _chat(client, text).choices[0].token_ids == hf(text)


def _pool_metric(server, name: str, role: str) -> float:
    """One pool's sample of a /metrics family (0 before the first heartbeat that reports it)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("model") == "tiny-omni" and sample.labels.get("role") == role:
                assert family.type == ("counter" if name.endswith("_total") else "gauge"), (name, family.type)
                return sample.value
    return 0.0


def test_encode_worker_counters_are_exported_on_metrics(client, server):
    png = _png(11)
    requests_before = _pool_metric(server, "omnirelay_encode_requests_total", "encode")
    hits_before = _pool_metric(server, "omnirelay_encoder_cache_hits_total", "encode")
    for _ in range(2):   # the same picture twice: the second is taken from the encoder cache
        assert _chat(client, [image_part(png), {"type": "text", "text": "Again?"}]).choices[0].token_ids
    settled_workers(server.url)   # worker counters ride on heartbeats: read once the cluster says they are final
    encoded = _pool_metric(server, "omnirelay_encode_requests_total", "encode")
    hits = _pool_metric(server, "omnirelay_encoder_cache_hits_total", "encode")
    media_prompts = _pool_metric(server, "omnirelay_media_prompts_total", "prefill")
    decoded = _pool_metric(server, "omnirelay_decode_tokens_total", "decode")
    assert encoded >= requests_before + 2 and hits >= hits_before + 1, (encoded, hits)
    assert media_prompts >= 2 and decoded >= 2 * (MAX_TOKENS - 1), (media_prompts, decoded)
    assert _pool_metric(server, "omnirelay_encoder_cache_items", "encode") >= 1


BAD = base64.b64encode(b"not an image at all").decode()


@pytest.mark.parametrize("part, status, fragment", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@not-base64@@@"}}, 400, "base64"),
    ({"type": "image_url", "image_url": {"url": "data:text/plain;base64," + BAD}}, 400, "unsupported image type"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + BAD}}, 400, "cannot be decoded"),
    ({"type": "input_audio", "input_audio": {"data": BAD, "format": "mp3"}}, 400, "unsupported audio format"),
    ({"type": "input_audio", "input_audio": {"data": BAD, "format": "wav"}}, 400, "not a readable WAV"),
    ({"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(
        wav_bytes(_tone(300.0, 31.0))).decode()}}, 400, "at most 30 s"),
    ({"type": "image_url", "image_url": {"url": "/etc/passwd"}}, 400, "not under the allowed media directory"),
])
def test_bad_media_gets_a_clear_error_and_the_next_request_succeeds(client, part, status, fragment):
    with pytest.raises(openai.APIStatusError) as caught:
        _chat(client, [{"type": "text", "text": "hi"}, part])
    assert caught.value.status_code == status
    error = caught.value.response.json()["error"]
    assert fragment in error["message"]
    assert error["param"] == "messages[0].content[1]"
    assert len(_chat(client, [image_part(_png(2)), {"type": "text", "text": "ok?"}]).choices[0].token_ids) == MAX_TOKENS


def test_image_url_may_name_a_file_in_the_allowed_directory(client, media_dir, hf):
    png = _png(9)
    with open(os.path.join(media_dir, "picture.png"), "wb") as handle:
        handle.write(png)
    content = [{"type": "image_url", "image_url": {"url": os.path.join(media_dir, "picture.png")}},
               {"type": "text", "text": "Describe it."}]
    assert _chat(client, content).choices[0].token_ids == hf(content, png=png)
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, [{"type": "image_url", "image_url": {"url": os.path.join(media_dir, "..", "x.png")}}])
    assert "not under the allowed media directory" in caught.value.response.json()["error"]["message"]


def test_too_many_media_items(client):
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, [image_part(_png(3))] * 9)
    error = caught.value.response.json()["error"]
    assert "too many media items" in error["message"] and error["param"] == "messages[0].content[8]"


def test_media_over_the_inline_limit_is_413(client):
    # 29 s clips: ~1.2 MB of base64 each in the body, 1.86 MB each as the float32 PCM that travels;
    # the fourth takes the request past the 6 MiB inline limit.
    clip = audio_part(wav_bytes(_tone(500.0, 29.0)))
    with pytest.raises(openai.APIStatusError) as caught:
        _chat(client, [clip] * 4)
    error = caught.value.response.json()["error"]
    assert caught.value.status_code == 413
    assert "exceed" in error["message"] and error["param"] == "messages[0].content[3]"


def test_engines_chunk_media_prompts_mix_them_with_text_and_swap_them_when_preempted(tiny_omni, hf, tmp_path):
    """No network: encode → chunked prefill (chunks of 8 cut through the image and the audio, next to a
    text prompt in the same steps) → decode in a pool so small that a sequence is preempted."""
    from transformers import AutoTokenizer

    from omnirelay.connectors import create_connector
    from omnirelay.gateway.media import MediaLimits, MediaProcessor
    from omnirelay.workers.encode.engine import OmniEncoders
    from omnirelay.request_params import TextParams

    png, pcm = _png(5), _tone(660.0, 0.5)
    media_content = [{"type": "text", "text": "See"}, image_part(png), audio_part(wav_bytes(pcm)),
                     {"type": "text", "text": "and tell."}]
    text_content = [{"type": "text", "text": "Tell me a story about the river."}]
    tok = AutoTokenizer.from_pretrained(tiny_omni)
    media = MediaProcessor(tiny_omni, MediaLimits())
    messages, items = media.extract([{"role": "user", "content": media_content}])
    ids = media.expand(tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)["input_ids"], items)
    text_ids = tok(tok.apply_chat_template([{"role": "user", "content": text_content[0]["text"]}],
                                           add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
    connector = create_connector("shared_memory", {"shm_dir": str(tmp_path)})
    try:
        greedy = TextParams(max_tokens=MAX_TOKENS, temperature=0.0)
        encoded, model, done = encode_then_prefill(tiny_omni, OmniEncoders(tiny_omni), connector, items, ids,
                                                   text_ids, greedy)
        assert encoded.image_grids and encoded.audio_lengths
        assert done["m"].outputs.has_media and done["m"].outputs.rope_delta < 0

        # Room for both prompts to start, not for both to grow: the newest (the media one) is preempted.
        blocks = 1 + -(-(len(ids) + 1) // 4) + -(-(len(text_ids) + 1) // 4) + 1
        outputs, stats = decode_prefilled(model, connector, done, {"t": text_ids, "m": ids}, greedy, blocks)
        assert stats["preemptions"] > 0 and stats["kv_swapped_in"] > 0   # the media one came back
        assert outputs["m"] == hf(media_content, png=png, pcm=pcm)
        assert outputs["t"] == hf(text_content)
    finally:
        connector.close()


def test_local_media_files_only_under_the_allowed_directory(tiny_omni, tmp_path):
    from omnirelay.errors import BadRequest
    from omnirelay.gateway.media import MediaLimits, MediaProcessor

    allowed, outside = tmp_path / "media", tmp_path / "private"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "cat.png").write_bytes(_png(7))
    (outside / "secret.png").write_bytes(_png(8))
    (allowed / "link.png").symlink_to(outside / "secret.png")
    processor = MediaProcessor(tiny_omni, MediaLimits(allowed_local_dir=str(allowed)))

    def part(url: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]

    _, (item,) = processor.extract(part(f"file://{allowed}/cat.png"))
    assert item.kind == "image" and item.data == _png(7) and item.tokens > 0
    for url in (str(outside / "secret.png"), f"{allowed}/../private/secret.png", str(allowed / "link.png"),
                str(allowed / "missing.png")):
        with pytest.raises(BadRequest, match="not under the allowed media directory"):
            processor.extract(part(url))
    with pytest.raises(BadRequest, match="not enabled"):
        MediaProcessor(tiny_omni, MediaLimits()).extract(part(str(allowed / "cat.png")))
