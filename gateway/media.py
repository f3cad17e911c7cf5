"""Media in chat requests (Qwen2.5-Omni): validate, decode, count placeholder tokens, build the prompt.

Life of a chat request with media through this module (called from ``generation.prepare``)::

    messages with content parts ──▶ each image_url / input_audio / audio_url part: fetch its bytes
        (a data: URL or base64; a local file only under --allowed-local-media-path), check its type
        and size, read its header and check what it declares (below) ──▶ check the file's structure
        (images) or convert it (WAV) ──▶ count the tokens it becomes (below) ──▶ the model's chat
        template renders one <|vision_bos|><|IMAGE|><|vision_eos|> (or audio) triple per part ──▶
        each placeholder is expanded to its token count ──▶ (prompt ids, media items for encode)

Who counts the placeholder tokens: the gateway, here. The count depends only on an image's size
(Qwen2-VL's ``smart_resize`` to the processor's pixel bounds, then one token per 2x2 patches) and an
audio clip's length (Whisper frames, then two stride-2 steps), both cheap to get without running a
feature extractor; knowing it here keeps the prompt a fixed list of token ids from the first stage
on (context-length checks, usage, routing, and the KV length decode checks all agree). The encode
worker reports the grids and frame counts it actually produced; prefill refuses a mismatch.

Bounded before the work: an image's declared width × height (PIL reads only the header when it
opens a file) is checked against ``max_image_pixels`` before anything is decoded, and the gateway
never decodes the pixels at all: it verifies the file's structure and leaves decoding to the encode
worker, once. A WAV's declared sample rate (``min/max_audio_sample_rate``) and duration (the model's
clip length) are checked from its header before a sample is read or resampled. So a few hundred bytes
declaring a 12000×12000 image, or a WAV at 1 Hz, cost a header read and a 400.

What travels: images as their original file bytes (decoded by the encode worker), audio as float32 little-endian PCM at 16 kHz (WAV of any rate and 8/16/32-bit PCM is
converted here: linear interpolation when the rate differs), inline in the Submit's ``inputs``. The
total is bounded below the bus message limit; a larger request is refused with 413.

Errors (OpenAI-style, ``param`` naming the part, e.g. ``messages[0].content[1]``): bad base64, a
type that is not an image / WAV audio, undecodable data, an image or clip out of bounds → 400; too
many media items → 400; more bytes than the limits → 413. An image or clip whose header declares more
than the limits (pixels, sample rate, duration) → 400 saying which limit, before it is decoded.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import json
import os
import wave
from pathlib import Path

import numpy as np

from omnirelay.broker.protocol import MAX_BODY_BYTES
from omnirelay.errors import BadRequest, PayloadTooLarge
from omnirelay.handoffs import MAX_IMAGE_PIXELS_CEILING

MEDIA_PARTS = ("image_url", "input_audio", "audio_url")
SAMPLE_RATE = 16000
IMAGE_MIMES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp")
AUDIO_MIMES = {"audio/wav": "wav", "audio/wave": "wav", "audio/x-wav": "wav"}


@dataclasses.dataclass(frozen=True)
class MediaLimits:
    max_items: int = 8                          # media parts per request
    max_total_bytes: int = 6 * 1024 * 1024      # what travels inline, all items (bus limit: 8 MiB)
    allowed_local_dir: str | None = None        # image_url may name files under it (operator flag)
    # Checked from the file's header before any decoding (operator flags, gateway/config.py).
    max_image_pixels: int = 25_000_000          # width × height an image may declare
    min_audio_sample_rate: int = 8000           # Hz a WAV may declare: a low rate is a large resample
    max_audio_sample_rate: int = 192_000

    def __post_init__(self) -> None:
        if not 0 < self.max_total_bytes <= MAX_BODY_BYTES - 512 * 1024:
            raise ValueError(f"max_total_bytes must leave room in one bus message ({MAX_BODY_BYTES} bytes)")
        if not 0 < self.max_image_pixels <= MAX_IMAGE_PIXELS_CEILING:
            raise ValueError(f"max_image_pixels must be in 1..{MAX_IMAGE_PIXELS_CEILING} (the encode worker's bound)")
        if not 0 < self.min_audio_sample_rate <= self.max_audio_sample_rate:
            raise ValueError("audio sample rate bounds must satisfy 0 < min_audio_sample_rate <= max_audio_sample_rate")


@dataclasses.dataclass
class Media:
    kind: str           # "image" | "audio"
    data: bytes         # image: file bytes; audio: f32le PCM at 16 kHz
    tokens: int         # placeholder tokens it expands to


class MediaProcessor:
    """The media rules of one omni model directory (its preprocessor_config.json and token ids)."""

    def __init__(self, path: str, limits: MediaLimits):
        root = Path(path)
        pre = json.loads((root / "preprocessor_config.json").read_text())
        raw = json.loads((root / "config.json").read_text())
        thinker = raw["thinker_config"]
        self.limits = limits
        self.patch = int(pre.get("patch_size", 14))
        self.merge = int(pre.get("merge_size", 2))
        size = pre.get("size") or {}
        self.min_pixels = int(size.get("shortest_edge", pre.get("min_pixels", 56 * 56)))
        self.max_pixels = int(size.get("longest_edge", pre.get("max_pixels", 28 * 28 * 1280)))
        self.hop = int(pre.get("hop_length", 160))
        self.max_samples = int(pre.get("n_samples", 30 * SAMPLE_RATE))
        # Qwen2.5-Omni names them *_token_index, Qwen3-Omni *_token_id.
        self.image_token_id = int(thinker.get("image_token_index", thinker.get("image_token_id")))
        self.audio_token_id = int(thinker.get("audio_token_index", thinker.get("audio_token_id")))
        # Qwen3-Omni counts audio tokens per 100-frame chunk; 0 keeps Qwen2.5-Omni's rule.
        self.audio_n_window = int(thinker["audio_config"].get("n_window", 50)) \
            if raw.get("model_type") == "qwen3_omni_moe" else 0

    # ---------------------------------------------------------------- per request

    def extract(self, messages: list[dict]) -> tuple[list[dict], list[Media]]:
        """Messages for the chat template (media parts reduced to their type) and the media items
        in prompt order. Raises BadRequest / PayloadTooLarge."""
        items: list[Media] = []
        out = []
        for i, message in enumerate(messages):
            content = message["content"]
            if isinstance(content, str):
                out.append(message)
                continue
            parts = []
            for j, part in enumerate(content):
                if part["type"] == "text":
                    parts.append(part)
                    continue
                param = f"messages[{i}].content[{j}]"
                if len(items) >= self.limits.max_items:
                    raise BadRequest(f"too many media items: at most {self.limits.max_items} per request", param=param)
                items.append(self._item(part, param))
                if sum(len(m.data) for m in items) > self.limits.max_total_bytes:
                    raise PayloadTooLarge(f"media in this request exceed {self.limits.max_total_bytes} bytes "
                                          "(decoded)", param=param)
                parts.append({"type": part["type"]})
            out.append({**message, "content": parts})
        return out, items

    def expand(self, prompt_ids: list[int], items: list[Media]) -> list[int]:
        """Replace the k-th image (audio) placeholder with image (audio) item k's token count."""
        counts = {self.image_token_id: [m.tokens for m in items if m.kind == "image"],
                  self.audio_token_id: [m.tokens for m in items if m.kind == "audio"]}
        found = {token: sum(1 for t in prompt_ids if t == token) for token in counts}
        if any(found[token] != len(counts[token]) for token in counts):
            raise BadRequest("the prompt's media placeholders do not match its media parts (is a placeholder "
                             "token such as <|IMAGE|> written in the text?)", param="messages")
        out: list[int] = []
        for token in prompt_ids:
            if token in counts:
                out.extend([token] * counts[token].pop(0))
            else:
                out.append(token)
        return out

    # ---------------------------------------------------------------- one part

    def _item(self, part: dict, param: str) -> Media:
        kind = part["type"]
        if kind == "image_url":
            mime, data = self._url_bytes(part["image_url"]["url"], param, "image")
            if mime not in IMAGE_MIMES:
                raise BadRequest(f"unsupported image type {mime!r} (expected one of {', '.join(IMAGE_MIMES)})",
                                 param=param)
            return self._image(data, param)
        if kind == "audio_url":
            mime, data = self._url_bytes(part["audio_url"]["url"], param, "audio")
            if mime not in AUDIO_MIMES:
                raise BadRequest(f"unsupported audio type {mime!r} (audio/wav is supported)", param=param)
            return self._audio(data, param)
        fmt = part["input_audio"]["format"]
        if fmt != "wav":
            raise BadRequest(f"unsupported audio format {fmt!r} (wav is supported)", param=param)
        return self._audio(_b64(part["input_audio"]["data"], param), param)

    def _url_bytes(self, url: str, param: str, what: str) -> tuple[str, bytes]:
        if url.startswith("data:"):
            header, sep, payload = url[5:].partition(",")
            if not sep or not header.endswith(";base64"):
                raise BadRequest(f"a {what} data URL must be data:<mime>;base64,<data>", param=param)
            return header[: -len(";base64")].lower(), _b64(payload, param)
        if url.startswith(("http://", "https://")):
            raise BadRequest(f"{what} URLs are not fetched by this server; send a data: URL", param=param)
        return self._local_file(url[len("file://"):] if url.startswith("file://") else url, param, what)

    def _local_file(self, path: str, param: str, what: str) -> tuple[str, bytes]:
        base = self.limits.allowed_local_dir
        if not base:
            raise BadRequest(f"local {what} files are not enabled on this server; send a data: URL", param=param)
        real, root = os.path.realpath(path), os.path.realpath(base)
        if os.path.commonpath([real, root]) != root or not os.path.isfile(real):
            raise BadRequest(f"{what} file is not under the allowed media directory", param=param)
        if os.path.getsize(real) > self.limits.max_total_bytes:
            raise PayloadTooLarge(f"{what} file exceeds {self.limits.max_total_bytes} bytes", param=param)
        with open(real, "rb") as handle:
            data = handle.read()
        ext = os.path.splitext(real)[1].lower().lstrip(".")
        mime = {"png": "image/png", "jpg": "image/jpeg", "jpeg": "image/jpeg", "webp": "image/webp",
                "gif": "image/gif", "bmp": "image/bmp", "wav": "audio/wav"}.get(ext, "application/octet-stream")
        return mime, data

    def _image(self, data: bytes, param: str) -> Media:
        """Checked from the header and the file's structure; the pixels are decoded only by the encode
        worker (PIL's ``open`` reads the header, ``verify`` walks the chunks without decompressing)."""
        from PIL import Image, UnidentifiedImageError
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        if len(data) > self.limits.max_total_bytes:
            raise PayloadTooLarge(f"image exceeds {self.limits.max_total_bytes} bytes", param=param)
        try:
            with Image.open(io.BytesIO(data)) as img:
                width, height = img.size   # declared by the header; nothing decoded yet
                if width * height > self.limits.max_image_pixels:
                    raise BadRequest(f"the image declares {width}x{height} pixels; at most "
                                     f"{self.limits.max_image_pixels} pixels (--max-image-pixels)", param=param)
                img.verify()   # structure and checksums; a malformed file fails here
            h, w = smart_resize(height, width, factor=self.patch * self.merge, min_pixels=self.min_pixels,
                                max_pixels=self.max_pixels)
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            raise BadRequest(f"the image cannot be decoded: {exc}", param=param) from None
        return Media("image", data, (h // self.patch) * (w // self.patch) // self.merge ** 2)

    def _audio(self, data: bytes, param: str) -> Media:
        from omnirelay.mrope import audio_output_length, qwen3_audio_output_length

        limits = self.limits
        try:
            with wave.open(io.BytesIO(data)) as wav:
                channels, width, rate = wav.getnchannels(), wav.getsampwidth(), wav.getframerate()
                # The header's claims, checked before a sample is read: the resample below makes
                # frames × 16000 / rate samples, so a low rate or a long clip is a large array.
                if not limits.min_audio_sample_rate <= rate <= limits.max_audio_sample_rate:
                    raise BadRequest(f"the WAV declares a sample rate of {rate} Hz; accepted: "
                                     f"{limits.min_audio_sample_rate}..{limits.max_audio_sample_rate} Hz "
                                     "(--min-audio-sample-rate, --max-audio-sample-rate)", param=param)
                if wav.getnframes() / rate * SAMPLE_RATE > self.max_samples:
                    raise BadRequest(f"audio is {wav.getnframes() / rate:.1f} s; at most "
                                     f"{self.max_samples / SAMPLE_RATE:.0f} s per clip", param=param)
                frames = wav.readframes(wav.getnframes())
        except (wave.Error, EOFError) as exc:
            raise BadRequest(f"the audio is not a readable WAV file: {exc}", param=param) from None
        if width not in (1, 2, 4) or not frames:
            raise BadRequest("WAV audio must be 8/16/32-bit PCM with at least one sample", param=param)
        dtype = {1: np.uint8, 2: "<i2", 4: "<i4"}[width]
        pcm = np.frombuffer(frames[: len(frames) // (width * channels) * width * channels], dtype=dtype)
        pcm = pcm.astype(np.float32)
        pcm = (pcm - 128.0) / 128.0 if width == 1 else pcm / float(2 ** (8 * width - 1))
        pcm = pcm.reshape(-1, channels).mean(axis=1)
        if rate != SAMPLE_RATE:
            target = int(round(len(pcm) * SAMPLE_RATE / rate))
            pcm = np.interp(np.arange(target) * (rate / SAMPLE_RATE), np.arange(len(pcm)), pcm).astype(np.float32)
        if len(pcm) > self.max_samples:
            raise BadRequest(f"audio is {len(pcm) / SAMPLE_RATE:.1f} s; at most {self.max_samples / SAMPLE_RATE:.0f} s "
                             "per clip", param=param)
        if len(pcm) < 4 * self.hop:
            raise BadRequest("audio is too short (under 40 ms)", param=param)
        frames_out = -(-len(pcm) // self.hop)   # Whisper's attention mask: one frame per hop started
        tokens = qwen3_audio_output_length(frames_out, self.audio_n_window) if self.audio_n_window \
            else audio_output_length(frames_out)
        return Media("audio", pcm.astype("<f4").tobytes(), tokens)


def _b64(text: str, param: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("media data is not valid base64", param=param) from None
