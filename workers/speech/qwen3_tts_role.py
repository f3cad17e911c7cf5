"""The generate role for Qwen3-TTS: the speech role (role.py) reading its tasks with :class:`TTSInputs`.

Life of a request through it::

    Task (what the gateway sends every speech model for ``POST /v1/audio/speech``: the chat prompt,
          then from ``SpeechParams.reply_start`` on the text's ids + ``<|im_end|>``; params: the
          SpeechParams, ``stream`` for streamed requests; no inputs: no stage before)
        ──accept: the text's ids wrapped as the package wraps its text (``Qwen3TTSFamily.wrap``; the chat
          prompt before them is a thinker's and unused here) ──▶ a TTSTask queued in the engine
          (bad_request for an unknown voice, a chat reply to speak, or a malformed text)
        ──step: the waveform, or its streamed pieces ──▶ MediaResults to the gateway's ``reply_to``,
          then StageDone(finished=True) to the broker; or one StageFailed

Everything after accept — encoding (wav | pcm | flac), chunking into MediaResults, streamed pieces
behind a streamed WAV header, failures — is the speech role's (:class:`~.role.GenerateSpeechRole`,
whose docstring has the details): the models differ only in where the task comes from. A Qwen3-TTS
request has no hidden states on a connector, so there are no input keys to read or release, and the
role holds no connector.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from omnirelay.broker import protocol as p
from omnirelay.errors import BadRequest
from omnirelay.speech_params import SpeechParams

from omnirelay.workers.runtime.assembly import BuiltRole
from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.speech.engine import GenerateSpeechEngine
from omnirelay.workers.speech.qwen3_tts import Qwen3TTSFamily, TTSTask, load_family
from omnirelay.workers.speech.role import GenerateSpeechRole

log = logging.getLogger("omnirelay.worker.speech")


class TTSInputs:
    """A Qwen3-TTS task: the text after ``reply_start``, wrapped as the family's talker reads it."""

    def __init__(self, family: Qwen3TTSFamily):
        self.family = family

    def read(self, task: p.Task, params: SpeechParams) -> TTSTask:
        if params.reply_start < 0:
            raise BadRequest("Qwen3-TTS speaks the input of POST /v1/audio/speech, not a chat reply",
                             param="modalities")
        reply = [int(t) for t in task.prompt_token_ids[params.reply_start:]]
        if len(reply) < 2 or reply[-1] != self.family.im_end:
            raise BadRequest("the text to speak must follow reply_start and end with <|im_end|>", param="input")
        return TTSTask(task.request_id, self.family.wrap(reply[:-1]), params, task.deadline)


def build_qwen3_tts_role(config: WorkerConfig, on_fatal: Callable[[str], None] | None = None) -> BuiltRole:
    """A Qwen3-TTS generate worker (``config.model_path`` a Qwen3-TTS 12 Hz CustomVoice directory;
    first CUDA device when there is one); no connector: nothing flows in from another stage."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    family = load_family(config.model_path, dtype=getattr(torch, config.dtype), device=device)
    engine = GenerateSpeechEngine(family, device=device, max_batch_size=config.capacity)
    log.info("Qwen3-TTS generate worker: %s on %s, voices %s", config.model_path, device, ", ".join(engine.voices))

    def stats() -> dict:
        return {**engine.load(), **engine.stats}

    return BuiltRole(GenerateSpeechRole(config.worker_id, engine, None, inputs=TTSInputs(family)), stats, owned=())
