"""What a speech request asks for: one typed struct shared by the gateway and the speech worker.

The gateway builds :class:`SpeechParams` from ``POST /v1/audio/speech`` (then it is the request's
params, tag ``speech``) or from a chat request with ``modalities: ["text", "audio"]`` (then it is
the ``speech`` of its :class:`~omnirelay.request_params.TextParams`). Three stages read it:

* prefill and decode: its presence means "export the thinker's last-layer hidden states" (the talker
  is conditioned on them); prefill also keeps every prompt token's state then (no prefix-cache skip);
* generate: the voice, the encoding, the seed of the talker's sampling and of token2wav's noise,
  where in the prompt the spoken reply starts, and whether the client streams the audio.

Its checks run where the gateway builds it and where the bus decodes it (omnirelay/request_params.py).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from omnirelay.errors import InvalidParam

FORMATS = ("wav", "pcm", "flac")
MAX_SEED = 2**63 - 1
MAX_CODES = 8192          # talker codec tokens (~164 s of speech at 50 codes/s)
# max_codes 0 ("auto") bounds the talker by the text it speaks: 25 codes (half a second of speech)
# per reply token, plus a second. Speech runs at ~0.2-0.3 s per token, so a trained talker ends on
# its own codec EOS well before; an untrained one (the tiny test model) stops in proportion.
CODES_PER_TOKEN, CODES_MARGIN = 25, 50
MIN_SPEED, MAX_SPEED = 0.25, 4.0


class SpeechParams(msgspec.Struct, tag="speech", frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """voice: a speaker of the model's ``spk_dict.pt``; format: ``wav`` (16-bit PCM RIFF),
    ``pcm`` (raw 16-bit little-endian mono at the model's rate), ``flac``; seed: the random seed of
    the talker's sampling and token2wav's noise (the gateway always sets one, so a retried stage
    speaks the same); max_codes: the talker's ``max_new_tokens`` (0: :func:`auto_max_codes` of the
    reply's length); speed: playback speed (0.25–4);
    reply_start: -1 for a chat reply (the decode stage's tokens are spoken), else the index of the
    first prompt token to speak (``/v1/audio/speech``: the text is teacher-forced as the assistant's
    reply, so prefill alone computes every hidden state the talker needs); stream: the client reads
    the audio as it is made (a streamed chat, ``stream_format: "sse"``), so the worker synthesizes
    it incrementally (wav and pcm; flac is encoded whole)."""

    voice: str
    format: str = "wav"
    seed: int = 0
    max_codes: int = 0
    speed: float = 1.0
    reply_start: int = -1
    stream: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.voice, str) or not self.voice:
            raise InvalidParam("'voice' must be a non-empty string", param="voice")
        if self.format not in FORMATS:
            raise InvalidParam(f"'response_format' must be one of {', '.join(FORMATS)}, got {self.format!r}",
                             param="response_format")
        _check_int(self.seed, "seed", 0, MAX_SEED)
        _check_int(self.max_codes, "max_codes", 0, MAX_CODES)
        _check_int(self.reply_start, "reply_start", -1, None)
        if isinstance(self.speed, bool) or not isinstance(self.speed, (int, float)) or not math.isfinite(self.speed) \
                or not MIN_SPEED <= self.speed <= MAX_SPEED:
            raise InvalidParam(f"'speed' must be a number between {MIN_SPEED} and {MAX_SPEED}", param="speed")
        msgspec.structs.force_setattr(self, "speed", float(self.speed))


    def codes_for(self, reply_tokens: int) -> int:
        """The talker's token budget for a reply of ``reply_tokens`` text tokens."""
        return self.max_codes or min(MAX_CODES, CODES_PER_TOKEN * reply_tokens + CODES_MARGIN)


def _check_int(value: Any, name: str, lo: int, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise InvalidParam(f"'{name}' must be an integer {bound}", param=name)
