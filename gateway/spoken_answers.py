"""Transcripts of this gateway's spoken chat answers, by audio id: OpenAI's multi-turn audio.

A chat answer spoken with ``modalities: ["text", "audio"]`` carries ``message.audio`` ``{id,
transcript, expires_at}`` (gateway/routes/speech.py). A client continues the conversation by sending
that turn back as ``{"role": "assistant", "audio": {"id": …}}``, without its text, as OpenAI's
clients do; the turn is then the answer's transcript, which :func:`resolve_audio_turns` puts in as
the message's content. An id this gateway never gave, or one past its ``expires_at``, is a 400
naming ``messages[i].audio.id`` — never a prompt that silently lost the turn.

The store is per gateway and in memory (one :class:`SpokenAnswers` on the app): behind several
gateways a conversation must come back to the gateway that spoke its answers, and a restart forgets
them. It is bounded: at most :data:`MAX_ANSWERS` transcripts and :data:`MAX_CHARS` characters in all;
beyond either the oldest go first, as do answers past their expiry (all share one lifetime, so the
oldest expire first).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

from omnirelay.errors import BadRequest

MAX_ANSWERS = 4096
MAX_CHARS = 16 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class _Answer:
    transcript: str
    expires_at: float


class SpokenAnswers:
    """Audio id → transcript until its ``expires_at`` (unix seconds). Locked: /tokenize reads it from
    the gateway's CPU pool while spoken answers are kept from the event loop."""

    def __init__(self, max_answers: int = MAX_ANSWERS, max_chars: int = MAX_CHARS):
        self.max_answers = max_answers
        self.max_chars = max_chars
        self._answers: collections.OrderedDict[str, _Answer] = collections.OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._answers)

    def keep(self, audio_id: str, transcript: str, expires_at: float) -> None:
        with self._lock:
            self._drop(audio_id)
            self._answers[audio_id] = _Answer(transcript, expires_at)
            self._chars += len(transcript)
            self._evict(time.time())

    def transcript(self, audio_id: str) -> str | None:
        """The answer's transcript, or None if unknown or expired."""
        now = time.time()
        with self._lock:
            self._evict(now)
            answer = self._answers.get(audio_id)
        return None if answer is None or answer.expires_at <= now else answer.transcript

    def _drop(self, audio_id: str) -> None:
        answer = self._answers.pop(audio_id, None)
        if answer is not None:
            self._chars -= len(answer.transcript)

    def _evict(self, now: float) -> None:
        while self._answers:
            oldest_id, oldest = next(iter(self._answers.items()))
            if oldest.expires_at > now and len(self._answers) <= self.max_answers and self._chars <= self.max_chars:
                return
            self._drop(oldest_id)


def audio_reference(message: dict, index: int) -> str | None:
    """The audio id an assistant message refers to (``"audio": {"id": …}``), None without one; 400
    naming the param for any other shape."""
    audio = message.get("audio")
    if audio is None or message.get("role") != "assistant":
        return None
    if not isinstance(audio, dict) or not isinstance(audio.get("id"), str) or not audio["id"]:
        raise BadRequest(f"messages[{index}].audio must be {{\"id\": <the id of an earlier spoken answer>}}",
                         param=f"messages[{index}].audio")
    return audio["id"]


def resolve_audio_turns(messages: list[dict], answers: SpokenAnswers) -> list[dict]:
    """``messages`` (gateway/schema.py's, where an assistant turn given by its audio carries
    ``audio_id``) with each such turn's content the answer's transcript (content the client sent
    too stays as it is). 400 naming ``messages[i].audio.id`` for an unknown or expired id."""
    if not any("audio_id" in m for m in messages):
        return messages
    out = []
    for i, message in enumerate(messages):
        if "audio_id" not in message:
            out.append(message)
            continue
        message = dict(message)
        audio_id = message.pop("audio_id")
        transcript = answers.transcript(audio_id)
        if transcript is None:
            raise BadRequest(f"messages[{i}].audio.id {audio_id!r} is not a spoken answer of this server, or it "
                             "expired", param=f"messages[{i}].audio.id")
        if not message["content"]:
            message["content"] = transcript
        out.append(message)
    return out
