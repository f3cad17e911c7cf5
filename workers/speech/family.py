"""What a speech model family gives the engine: a :class:`SpeechFamily` strategy, the
:class:`Talk` of one request, and the one :class:`StreamingVocoder` protocol of the streamed vocoders.

Who calls what, on a request's synthesis thread (engine.py ``_talk``, ``synthesize``,
``synthesize_stream``), in this order::

    family.check(task)                       on add(), on the worker's loop: BadRequest for what the model cannot speak
    family.prompt(task)                      outside the turn: may wait for the thinker's first chunk
    family.start(task, prompt, generator)    holding the engine's turn (the talker's prompt forward): a Talk
    talk.spoken()                            the codes the prompt forward completed
    while not talk.done():                   its codec EOS or its budget
        talk.prepare()                       the next step's input, on the Talk's row
        (the step batch runs family.step(batch_kv, seats) over every ready request's row)
        talk.spoken()                        the codes that step completed
    one-shot: family.vocode(task, codes, generator)              the waveform of every code, in a vocoder slot
    streamed: family.vocoder(task, on_piece) → StreamingVocoder  fed after each new code, finished at the end

A family holds its model's modules and facts (loaded once per worker) and never a request's state:
that is the Talk's (one per request) and the request record's (requests.py). Families do not
subclass one another; what two share is a function of a module they both import.

A code is whatever one talker step completes, as the family's vocoders read it: an ``int`` codec id
(Qwen2.5-Omni), a ``[1, groups]`` tensor (Qwen3-Omni) or a ``[groups]`` tensor (Qwen3-TTS).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol, Sequence

import torch

from omnirelay.speech_params import SpeechParams

from omnirelay.workers.speech.reply_source import ReplySource
from omnirelay.workers.speech.step_batch import Seat
from omnirelay.workers.speech.talker_batch import BatchKV

# ``on_piece(waveform, codes spoken so far, final)``: a streamed vocoder's piece, in order. The
# engine numbers the pieces, applies the request's speed and hands them to the role adapter.
PieceSink = Callable[[torch.Tensor, int, bool], None]


class SpeechTaskLike(Protocol):
    """What the engine and the role read of any family's task (engine.py ``SpeechTask``, qwen3_tts.py
    ``TTSTask``); the role sets ``stream`` and ``priority`` from the bus task."""

    request_id: str
    params: SpeechParams
    deadline: float
    stream: bool
    priority: int

    def bind_stop(self, stop: threading.Event) -> None:
        """``stop`` is set when the request is cancelled: a wait for its inputs ends on it."""


class StreamingVocoder(Protocol):
    """One streamed request's vocoder: codes in as the talker speaks them, waveform pieces out
    through its :data:`PieceSink` on a fixed plan (the same pieces on every worker for the same
    codes, so a retry elsewhere resumes a stream by piece index)."""

    @property
    def pieces(self) -> int:
        """Pieces emitted so far (the first one is urgent: engine.py ``_vocode``)."""

    def ready(self, count: int) -> bool:
        """Whether :meth:`feed` of ``count`` codes would vocode a piece (else it only collects them)."""

    def feed(self, codes: Sequence[Any]) -> None:
        """Every code spoken so far (each call extends the previous one's); emits each piece they complete."""

    def finish(self) -> None:
        """The talker is done: emit the rest as the final piece (possibly empty)."""


class Talk(Protocol):
    """One request's talker, from its prompt forward to its last code (a family's own class)."""

    @property
    def row(self) -> Any:
        """What the step batch carries for it: the family's row, read and advanced by ``SpeechFamily.step``."""

    @property
    def reply(self) -> ReplySource | None:
        """The thinker reply it reads step by step (a wait for it steps away from the batch), if any."""

    def spoken(self) -> list[Any]:
        """The codes the last forward (the prompt's, then each step's) completed."""

    def done(self) -> bool:
        """Whether the talker has ended: its codec EOS, or its budget of codes."""

    def prepare(self) -> None:
        """Set the row's input of the next step."""


class SpeechFamily(Protocol):
    """A speech model family as the engine runs it (the call order: the module docstring)."""

    @property
    def voices(self) -> list[str]: ...

    def check(self, task: Any) -> None:
        """Raise BadRequest (naming the param) for what this model cannot speak."""

    def prompt(self, task: Any) -> Any:
        """The talker's prompt, built outside the turn (may wait for the thinker's first chunk)."""

    def start(self, task: Any, prompt: Any, generator: torch.Generator) -> Talk:
        """The prompt forward, holding the turn (it sets the shared talker module's M-RoPE state)."""

    def step(self, batch_kv: BatchKV, seats: list[Seat]) -> None:
        """One batched talker step of these seats' rows (a StepBatch run)."""

    def vocode(self, task: Any, codes: list[Any], generator: torch.Generator) -> torch.Tensor:
        """The one-shot waveform (float32, 1-D, before ``speed``) of ``codes`` (not empty);
        ``generator``: the request's, where the talker left it."""

    def vocoder(self, task: Any, on_piece: PieceSink) -> StreamingVocoder:
        """A streamed request's vocoder."""
