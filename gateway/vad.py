"""Server-side turn detection for ``/v1/realtime`` (``turn_detection: {"type": "server_vad"}``): where a
speaker's turn starts and ends in the audio a client streams, found by Silero VAD.

Silero VAD (the ``silero-vad`` package, which ships its weights) is a small recurrent network that
gives, for each 32 ms window of 16 kHz audio (512 samples, read with the 64 samples before it), the
probability that it holds speech. The package's TorchScript module keeps one stream's recurrent state
inside itself; its inner 16 kHz network is stateless (audio and state in, probability and state out),
so one loaded copy serves every session and each :class:`SpeechDetector` carries its own state. The
network is loaded once, on first use, off the event loop (:func:`load_model`).

Life of a turn through a detector (OpenAI's server VAD, its parameters in :class:`TurnDetection`)::

    feed(pcm at the input rate) ──▶ cut into 32 ms windows, each resampled to 512 samples at 16 kHz
        (linear interpolation: the band below 4 kHz that tells speech apart survives it)
    quiet ──(a window's probability >= threshold)──▶ speaking:
        SpeechStarted(audio_start_ms = the window's start - prefix_padding_ms)
    speaking ──(windows below threshold - 0.15 for silence_duration_ms)──▶ quiet:
        SpeechStopped(audio_end_ms = the end of that silence)

Times are milliseconds of audio fed to the detector since the session began (Realtime's
``audio_start_ms`` / ``audio_end_ms``), not wall-clock time. The hysteresis (a lower threshold to
stay in speech) is Silero's own ``VADIterator`` rule, so a syllable's dip does not end a turn.

A detector is not thread-safe: its owner feeds it one call at a time (the session awaits each
append's :meth:`SpeechDetector.feed`). A window costs about 0.3 ms of CPU (1 % of a core for a live
stream), more for a long append at once, so the session runs ``feed`` on the gateway's CPU pool.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any

import numpy as np

from omnirelay.errors import BadRequest, Unprocessable

VAD_RATE = 16000
WINDOW = 512                      # samples at VAD_RATE the network reads at once (32 ms)
WINDOW_MS = 1000 * WINDOW // VAD_RATE
CONTEXT = 64                      # samples before each window the network also reads
STAY_MARGIN = 0.15                # speaking goes on while the probability stays above threshold - this
MAX_PADDING_MS = 10_000
MAX_SILENCE_MS = 10_000

_model = None
_model_lock = threading.Lock()


def load_model():
    """Silero VAD's 16 kHz network (TorchScript), loaded once per process. Blocking (it imports torch
    the first time): call it off the event loop."""
    global _model
    with _model_lock:
        if _model is None:
            import torch
            from silero_vad import load_silero_vad
            # Its import sets one intra-op thread for the process, and we keep it so: the gateway runs no
            # other torch work, and on a busy 2-core host a window took 7.4 ms of CPU with 2 threads
            # (contention over a tiny network) and 0.26 ms with one.
            torch.set_num_threads(1)
            with warnings.catch_warnings():   # torch.jit.load's deprecation notice is the package's to heed
                warnings.simplefilter("ignore", DeprecationWarning)
                _model = load_silero_vad()._model
    return _model


@dataclasses.dataclass(frozen=True)
class TurnDetection:
    """``turn_detection`` of a Realtime session: OpenAI's ``server_vad`` fields and defaults."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def to_json(self) -> dict:
        return {"type": "server_vad", **dataclasses.asdict(self), "idle_timeout_ms": None}

    @classmethod
    def parse(cls, raw: Any, param: str) -> "TurnDetection | None":
        """``None`` turns detection off; an object is validated field by field (an error names it)."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise BadRequest(f"'{param}' must be an object or null", param=param)
        kind = raw.get("type")
        if kind != "server_vad":
            raise Unprocessable(f"{param}.type {kind!r} is not served; this server detects turns with "
                                "'server_vad' (Silero VAD)", param=f"{param}.type")
        fields: dict[str, Any] = {}
        if raw.get("threshold") is not None:
            value = raw["threshold"]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise BadRequest(f"'{param}.threshold' must be a number from 0 to 1", param=f"{param}.threshold")
            fields["threshold"] = float(value)
        for name, bound in (("prefix_padding_ms", MAX_PADDING_MS), ("silence_duration_ms", MAX_SILENCE_MS)):
            value = raw.get(name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= bound:
                    raise BadRequest(f"'{param}.{name}' must be an integer from 0 to {bound}",
                                     param=f"{param}.{name}")
                fields[name] = value
        for name in ("create_response", "interrupt_response"):
            value = raw.get(name)
            if value is not None:
                if not isinstance(value, bool):
                    raise BadRequest(f"'{param}.{name}' must be a boolean", param=f"{param}.{name}")
                fields[name] = value
        if raw.get("idle_timeout_ms") is not None:
            raise Unprocessable(f"{param}.idle_timeout_ms is not supported by this server",
                                param=f"{param}.idle_timeout_ms")
        for key in raw.keys() - {"type", "threshold", "prefix_padding_ms", "silence_duration_ms",
                                 "create_response", "interrupt_response", "idle_timeout_ms"}:
            if raw[key] is not None:
                raise Unprocessable(f"{param}.{key} is not supported by this server", param=f"{param}.{key}")
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int


@dataclasses.dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int


class SpeechDetector:
    """One session's turn detection over the PCM16 mono audio it is fed at ``rate`` Hz."""

    def __init__(self, settings: TurnDetection, rate: int, model=None):
        self.settings = settings
        self.rate = rate
        self._model = model if model is not None else load_model()
        self._pending = np.zeros(0, dtype=np.float32)   # input samples not yet in a whole window
        self._consumed = 0                               # input samples before _pending
        self._windows = 0                                # windows read since the session began
        self._state = None                               # the network's recurrent state
        self._context = np.zeros(CONTEXT, dtype=np.float32)
        self.speaking = False
        self._last_speech_ms = 0                         # the end of the last window that kept speech on

    def reconfigure(self, settings: TurnDetection) -> None:
        self.settings = settings

    def end_turn(self) -> None:
        """The client committed or cleared the buffer itself: a turn in progress ends without a stop."""
        self.speaking = False

    def feed(self, pcm: bytes) -> list[SpeechStarted | SpeechStopped]:
        """The turn events the audio ``pcm`` (whole 16-bit samples) brings, in order. Blocking."""
        import torch

        samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
        self._pending = np.concatenate([self._pending, samples])
        events: list[SpeechStarted | SpeechStopped] = []
        with torch.inference_mode():
            while True:
                # Window k covers input samples [floor(k * rate * 32 ms), floor((k + 1) * rate * 32 ms)):
                # whole windows at any rate, with no drift between the input's clock and the VAD's.
                start = self._windows * self.rate * WINDOW // VAD_RATE
                end = (self._windows + 1) * self.rate * WINDOW // VAD_RATE
                consumed = self._consumed
                if end - consumed > len(self._pending):
                    break
                chunk = self._pending[start - consumed:end - consumed]
                self._pending = self._pending[end - consumed:]
                self._consumed = end
                probability = self._probability(torch, _resample(chunk, WINDOW))
                self._windows += 1
                event = self._step(probability)
                if event is not None:
                    events.append(event)
        return events

    def _probability(self, torch, window: np.ndarray) -> float:
        x = torch.from_numpy(np.concatenate([self._context, window]))[None, :]
        state = self._state if self._state is not None else torch.zeros(0)
        out, self._state = self._model(x, state)
        self._context = window[-CONTEXT:].copy()
        return float(out.reshape(-1)[0])

    def _step(self, probability: float) -> SpeechStarted | SpeechStopped | None:
        s = self.settings
        window_end_ms = self._windows * WINDOW_MS
        if not self.speaking:
            if probability >= s.threshold:
                self.speaking = True
                self._last_speech_ms = window_end_ms
                return SpeechStarted(max(0, window_end_ms - WINDOW_MS - s.prefix_padding_ms))
            return None
        if probability >= max(0.0, s.threshold - STAY_MARGIN):
            self._last_speech_ms = window_end_ms
        elif window_end_ms - self._last_speech_ms >= s.silence_duration_ms:
            self.speaking = False
            return SpeechStopped(window_end_ms)
        return None


def _resample(chunk: np.ndarray, length: int) -> np.ndarray:
    """``chunk`` stretched to ``length`` samples by linear interpolation (the window is 32 ms either way)."""
    if len(chunk) == length:
        return chunk
    where = (np.arange(length, dtype=np.float64) + 0.5) * len(chunk) / length - 0.5
    return np.interp(where, np.arange(len(chunk)), chunk).astype(np.float32)
