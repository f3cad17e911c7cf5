"""What a speech request asks for: one typed object shared by the gateway and the speech generate worker.

The gateway builds :class:`SpeechParams` from ``POST /v1/audio/speech`` or from a chat request with
``modalities: ["text", "audio"]`` and sends it under the key ``"audio"`` of the ``sampling`` map of
:class:`~omnirelay.broker.protocol.Submit` (:meth:`SpeechParams.to_wire`). Three stages read it:

* prefill and decode: its presence means "export the thinker's last-layer hidden states" (the talker
  is conditioned on them); prefill also keeps every prompt token's state then (no prefix-cache skip);
* generate: :meth:`SpeechParams.from_wire` — the voice, the encoding, the seed of the talker's
  sampling and of token2wav's noise, and where in the prompt the spoken reply starts.

Both sides run the same checks, so a malformed map on the bus is refused with ``bad_request``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from omnirelay.errors import BadRequest

FORMATS = ("wav", "pcm", "flac")
MAX_SEED = 2**63 - 1
MAX_CODES = 8192          # talker codec tokens (~164 s of speech at 50 codes/s)
# max_codes 0 ("auto") bounds the talker by the text it speaks: 25 codes (half a second of speech)
# per reply token, plus a second. Speech runs at ~0.2-0.3 s per token, so a trained talker ends on
# its own codec EOS well before; an untrained one (the tiny test model) stops in proportion.
CODES_PER_TOKEN, CODES_MARGIN = 25, 50
MIN_SPEED, MAX_SPEED = 0.25, 4.0


@dataclasses.dataclass(frozen=True)
class SpeechParams:
    """voice: a speaker of the model's ``spk_dict.pt``; format: ``wav`` (16-bit PCM RIFF),
    ``pcm`` (raw 16-bit little-endian mono at the model's rate), ``flac``; seed: the random seed of
    the talker's sampling and token2wav's noise (the gateway always sets one, so a retried stage
    speaks the same); max_codes: the talker's ``max_new_tokens`` (0: :func:`auto_max_codes` of the
    reply's length); speed: playback speed (0.25–4);
    reply_start: -1 for a chat reply (the decode stage's tokens are spoken), else the index of the
    first prompt token to speak (``/v1/audio/speech``: the text is teacher-forced as the assistant's
    reply, so prefill alone computes every hidden state the talker needs)."""

    voice: str
    format: str = "wav"
    seed: int = 0
    max_codes: int = 0
    speed: float = 1.0
    reply_start: int = -1

    def __post_init__(self) -> None:
        if not isinstance(self.voice, str) or not self.voice:
            raise BadRequest("'voice' must be a non-empty string", param="voice")
        if self.format not in FORMATS:
            raise BadRequest(f"'response_format' must be one of {', '.join(FORMATS)}, got {self.format!r}",
                             param="response_format")
        _check_int(self.seed, "seed", 0, MAX_SEED)
        _check_int(self.max_codes, "max_codes", 0, MAX_CODES)
        _check_int(self.reply_start, "reply_start", -1, None)
        if isinstance(self.speed, bool) or not isinstance(self.speed, (int, float)) or not math.isfinite(self.speed) \
                or not MIN_SPEED <= self.speed <= MAX_SPEED:
            raise BadRequest(f"'speed' must be a number between {MIN_SPEED} and {MAX_SPEED}", param="speed")
        object.__setattr__(self, "speed", float(self.speed))

    @classmethod
    def from_wire(cls, raw: Any) -> "SpeechParams":
        if not isinstance(raw, dict):
            raise BadRequest("the 'audio' entry of sampling must be a map")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise BadRequest(f"unknown speech parameters {sorted(map(str, unknown))}")
        return cls(**raw)

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def codes_for(self, reply_tokens: int) -> int:
        """The talker's token budget for a reply of ``reply_tokens`` text tokens."""
        return self.max_codes or min(MAX_CODES, CODES_PER_TOKEN * reply_tokens + CODES_MARGIN)


def _check_int(value: Any, name: str, lo: int, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise BadRequest(f"'{name}' must be an integer {bound}", param=name)
