"""Media bombs (issue #27, items 4 and 5): files of a few bytes to a few megabytes whose headers declare
far more than they carry, or ask for a huge resample, sent to a real gateway serving the tiny Omni.
Each must be refused with a 400 naming the part, from its header, before anything is decoded or
resampled, so the gateway's peak resident memory (``VmHWM``) grows by less than 100 MB over the lot.

Before the bounds, the JPEG and PNG were decoded in full (12000 x 12000 pixels: hundreds of MB), the
1 Hz WAV was resampled to 16 kHz (64 M samples, GBs of float64 in ``np.interp``) and the long WAV was
read and resampled before its length was checked.

The corpus is built here, in memory: a JPEG whose SOF marker is rewritten to declare 12000 x 12000,
a PNG of 12000 x 12000 zero pixels (it compresses to ~150 KB), a WAV of 4000 frames declared at 1 Hz
and a 8 kHz WAV of ~11 minutes. No worker is started: the gateway refuses before submitting.
"""

from __future__ import annotations

import base64
import io
import struct
import wave
import zlib

import numpy as np
import pytest
import requests
from PIL import Image

from cluster import Cluster
from media_support import audio_part, image_part, random_png, tiny_model_dir, wav_bytes
from omnirelay.deploy.builders.omni import build_tiny_omni

MODEL = "tiny-omni"
SIDE = 12000   # 144 M pixels: over --max-image-pixels, under PIL's own refusal (2 x 89 M)


def _jpeg_declaring(width: int, height: int) -> bytes:
    """A tiny real JPEG whose frame header (SOF0) claims ``width`` x ``height``."""
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (120, 30, 200)).save(out, "JPEG", quality=50)
    data = bytearray(out.getvalue())
    sof = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, height, width)   # marker, length (2), precision (1), then H, W
    return bytes(data)


def _png_of_zeros(width: int, height: int) -> bytes:
    """A valid grayscale PNG of ``width`` x ``height`` zero pixels, compressed row by row (so building it
    never holds the raw image)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    packer, idat, row = zlib.compressobj(9), [], b"\x00" * (width + 1)   # filter byte 0 + the pixels
    for _ in range(height):
        idat.append(packer.compress(row))
    idat.append(packer.flush())
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)   # 8-bit grayscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"".join(idat)) + chunk(b"IEND", b"")


def _wav(frames: bytes, rate: int, width: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as handle:
        handle.setnchannels(1)
        handle.setsampwidth(width)
        handle.setframerate(rate)
        handle.writeframes(frames)
    return out.getvalue()


def _jpeg_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(data).decode()}}


BOMBS = {
    "jpeg 12000x12000": (lambda: _jpeg_part(_jpeg_declaring(SIDE, SIDE)), "--max-image-pixels"),
    "png 12000x12000": (lambda: image_part(_png_of_zeros(SIDE, SIDE)), "--max-image-pixels"),
    "wav at 1 Hz": (lambda: audio_part(_wav(b"\x00\x01" * 4000, 1, 2)), "--min-audio-sample-rate"),
    "wav of 11 minutes": (lambda: audio_part(_wav(b"\x80" * (8000 * 660), 8000, 1)), "at most 30 s"),
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A broker and a gateway serving the tiny Omni (no workers: nothing here reaches one)."""
    model = tiny_model_dir(tmp_path_factory, MODEL, build_tiny_omni)
    with Cluster(model=model, log_dir=str(tmp_path_factory.mktemp("media-bombs")), model_name=MODEL) as cluster:
        cluster.start_broker()
        proc = cluster.start_gateway()
        yield cluster, proc


def _peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmHWM:"))


def _chat(url: str, parts: list[dict]) -> requests.Response:
    body = {"model": MODEL, "max_tokens": 1,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, *parts]}]}
    return requests.post(url + "/v1/chat/completions", json=body, timeout=120)


def test_media_bombs_are_refused_from_their_headers_with_little_memory(gateway):
    cluster, proc = gateway
    # Warm up every import and code path a media part takes (PIL's plugins, the resize rule, the WAV
    # reader): a good image and clip, then a part that fails, so nothing is submitted.
    tone = (np.sin(np.arange(16000) * 0.05) * 8000).astype("<i2")
    warm = _chat(cluster.url, [image_part(random_png(0, (64, 48))), audio_part(wav_bytes(tone)),
                               {"type": "input_audio", "input_audio": {"data": "@@", "format": "wav"}}])
    assert warm.status_code == 400 and warm.json()["error"]["param"] == "messages[0].content[3]", warm.text
    corpus = {name: build() for name, (build, _) in BOMBS.items()}
    before = _peak_rss_kb(proc.pid)
    for name, part in corpus.items():
        response = _chat(cluster.url, [part])
        assert response.status_code == 400, (name, response.status_code, response.text[:300])
        error = response.json()["error"]
        assert error["param"] == "messages[0].content[1]", (name, error)
        assert BOMBS[name][1] in error["message"], (name, error)
    grown_mb = (_peak_rss_kb(proc.pid) - before) / 1024
    assert grown_mb < 100, f"the gateway's peak RSS grew by {grown_mb:.0f} MB over the media bombs"
    assert proc.alive()
