"""What the gateway's spoken paths need to know of a served model's directory, read once when the
model is loaded (:class:`SpeechFacts`, ``ModelRuntime.speech``) instead of from disk on every spoken
request: its voices, whether it speaks at all, and its codes per second of audio.

Where each fact comes from:

* Qwen3-TTS (``model_kind`` ``qwen3-tts``): the speaker names of ``config.json``'s
  ``talker_config.spk_id``; codes per second from ``speech_tokenizer/config.json``
  (``output_sample_rate / decode_upsample_rate``, 12.5 for the 12 Hz codec);
* Qwen2.5-Omni / Qwen3-Omni: ``spk_dict.json``'s names (None when only a pickled ``spk_dict.pt``
  exists: the worker then checks the voice); 50 codes a second (``CODES_PER_SECOND``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from omnirelay.model_kind import ModelKind, model_kind, read_json

# Qwen2.5-Omni's codec runs at 50 codes a second (token2wav: 480 samples per code at 24 kHz).
CODES_PER_SECOND = 50


@dataclasses.dataclass(frozen=True)
class SpeechFacts:
    voices: tuple[str, ...] | None   # sorted speaker names; None: unknown here (the worker checks)
    has_speakers: bool               # a speaker table exists: the model can speak (with a generate stage)
    codes_per_second: float          # talker codes per second of audio (``usage.output_tokens`` of audio)

    @classmethod
    def read(cls, path: str) -> "SpeechFacts":
        """The facts of the model directory ``path`` (missing or unreadable files: no speakers)."""
        tts = qwen3_tts_speakers(path)
        if tts is not None:
            return cls(tuple(tts), bool(tts), _tts_codes_per_second(Path(path)))
        root = Path(path)
        try:
            names: tuple[str, ...] | None = tuple(sorted(json.loads((root / "spk_dict.json").read_text())))
        except (OSError, ValueError):
            names = None
        speaks = (root / "spk_dict.json").is_file() or (root / "spk_dict.pt").is_file()
        return cls(names, speaks, CODES_PER_SECOND)


def qwen3_tts_speakers(path: str) -> list[str] | None:
    """A Qwen3-TTS model's speaker names (its ``config.json``); None for any other model. Its
    generate worker takes the same request as a Qwen2.5-Omni's and speaks the text after
    ``reply_start`` (workers/speech/qwen3_tts_role.py); the chat prompt before it goes unused."""
    if model_kind(path) is not ModelKind.QWEN3_TTS:
        return None
    config = read_json(Path(path) / "config.json") or {}
    return sorted((config.get("talker_config") or {}).get("spk_id") or {})


def _tts_codes_per_second(root: Path) -> float:
    """A Qwen3-TTS codec frame is ``decode_upsample_rate`` samples (12.5 frames a second at 24 kHz)."""
    try:
        codec = json.loads((root / "speech_tokenizer" / "config.json").read_text())
        return float(codec["output_sample_rate"]) / float(codec["decode_upsample_rate"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return CODES_PER_SECOND
