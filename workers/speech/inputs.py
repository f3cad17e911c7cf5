"""What a speech role reads from a bus ``Task`` to queue in its engine: one :class:`SpeechInputs`
strategy per kind of model (the role adapter is the same for all, role.py).

* :class:`OmniInputs` (Qwen2.5-Omni, Qwen3-Omni): the thinker's hidden states, read from the
  connector the ``SpeechHandoff`` names — prefill's prompt states, then decode's reply states, or
  decode's streamed reply read chunk by chunk as the talker needs it (a :class:`ReplySource`);
  for ``/v1/audio/speech`` (``SpeechParams.reply_start >= 0``) the reply is the prompt's
  teacher-forced tail (role.py's module docstring has the layout).
* ``TTSInputs`` (Qwen3-TTS, qwen3_tts_role.py): the text's ids only; nothing on a connector.

A reader raises :class:`BadRequest` (naming the param where there is one) for a task it cannot
read, and an :class:`OmniError` when the connector cannot deliver; the role fails the task with it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from omnirelay.broker import protocol as p
from omnirelay.connectors import Connector
from omnirelay.errors import BadRequest
from omnirelay.handoffs import SpeechHandoff
from omnirelay.speech_params import SpeechParams

from omnirelay.workers.speech.engine import SpeechTask
from omnirelay.workers.speech.family import SpeechTaskLike
from omnirelay.workers.speech.reply_source import ReplySource


class SpeechInputs(Protocol):
    def read(self, task: p.Task, params: SpeechParams) -> SpeechTaskLike:
        """The engine's task for ``task`` (on the worker's loop; may block on the connector up to its timeout)."""


class OmniInputs:
    """The omni models' inputs: hidden states on ``connector`` (see the module docstring)."""

    def __init__(self, connector: Connector, transfer_timeout_s: float = 30.0):
        self.connector = connector
        self.transfer_timeout_s = transfer_timeout_s

    def read(self, task: p.Task, params: SpeechParams) -> SpeechTask:
        inputs = task.inputs
        if not isinstance(inputs, SpeechHandoff):
            raise BadRequest(f"no speech_prompt states in the task inputs ({type(inputs).__name__})")
        prompt = self._get("speech_prompt", inputs.speech_prompt_key, inputs.speech_prompt_handle)
        hidden = _tensor(prompt, "hidden")
        ids = list(task.prompt_token_ids)
        if hidden.shape[0] != len(ids):
            raise BadRequest(f"prefill sent states of {hidden.shape[0]} tokens for a prompt of {len(ids)}")
        if params.reply_start >= 0:   # /v1/audio/speech: the reply is the prompt's teacher-forced tail
            start = params.reply_start
            if not 0 < start <= len(ids) - 2:
                raise BadRequest(f"reply_start {start} leaves fewer than 2 reply tokens in a prompt of {len(ids)}")
            return SpeechTask(task.request_id, ids[:start], hidden[:start], ids[start:], hidden[start:-1], params,
                              task.deadline)
        grids = [[int(x) for x in grid] for grid in prompt.get("image_grids") or []]
        audio_lengths = [int(n) for n in prompt.get("audio_lengths") or []]
        if inputs.reply_stream is not None:   # decode still writes it: the talker reads it chunk by chunk
            reply = ReplySource.streamed(inputs.reply_stream, self.connector, timeout_s=self.transfer_timeout_s,
                                         deadline=task.deadline)
            return SpeechTask(task.request_id, ids, hidden, [], torch.zeros(0, 0), params, task.deadline,
                              image_grids=grids, audio_lengths=audio_lengths, reply_stream=reply)
        reply_states = self._get("speech_reply", inputs.speech_reply_key, inputs.speech_reply_handle)
        reply_ids = [int(t) for t in reply_states["token_ids"]]
        return SpeechTask(task.request_id, ids, hidden, reply_ids, _tensor(reply_states, "hidden"), params,
                          task.deadline, image_grids=grids, audio_lengths=audio_lengths)

    def _get(self, name: str, key: str, handle: dict | None) -> dict:
        if not key:
            raise BadRequest(f"no {name} states in the task inputs")
        return self.connector.get(key, handle, timeout=self.transfer_timeout_s)


def _tensor(payload: dict, name: str) -> torch.Tensor:
    value = payload[name]
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        raise BadRequest(f"'{name}' must be a 2-D tensor")
    return value.clone()   # a connector view pins backend memory while the request waits: keep a copy
