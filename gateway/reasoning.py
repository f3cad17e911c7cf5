"""Reasoning of thinking models: the model's ``<think>…</think>`` text split from its answer.

A model served with a reasoning parser (``--reasoning-parser`` on omni-serve/omni-gateway, or the
pipeline file's ``reasoning_parser``; vLLM's names, :data:`PARSERS`) answers a chat with the
reasoning in ``message.reasoning`` and in stream deltas' ``delta.reasoning`` (the field vLLM 0.32
emits; its older name ``reasoning_content`` is accepted on input messages), and only the answer in
``content``. Both parsers read the generated text:

* ``qwen3``: a ``<think>`` the model writes itself is dropped; the text before ``</think>`` is
  reasoning, the text after it is the answer. No ``</think>`` at all: everything is reasoning (the
  answer was cut while thinking), unless the request turned thinking off
  (``chat_template_kwargs.enable_thinking: false``), when everything is the answer.
* ``deepseek_r1``: the same, except that thinking cannot be turned off (the template opens the
  ``<think>`` block in the prompt).

When the prompt itself closes the reasoning (its last think tag is ``</think>``: Qwen3's template
with ``enable_thinking: false`` ends the prompt with an empty ``<think>\\n\\n</think>`` block) the
whole output is the answer, as vLLM decides from the prompt. ``include_reasoning: false`` drops the
reasoning from the answer (vLLM's meaning); the model still thinks.

What reads the answer reads the part after the reasoning: tool-call parsing (gateway/tool_calls.py
wraps under :class:`ReasoningFormat`, so it sees only the answer's text), and the grammar of
structured outputs and forced tool calls, which the sampling worker applies only once the output
holds ``</think>``'s token ids (``StructuredOutput.after``, set by gateway/generation.py) — unless
the prompt closed the reasoning, the reasoning is not returned (``include_reasoning: false``) or the
server runs with ``--structured-outputs-in-reasoning`` (vLLM's ``enable_in_reasoning``), when it holds
from the first token. A model that never writes the marker is never constrained, as in vLLM.

The split is incremental (:class:`ReasoningSplitter`): a streamed answer holds back only a tail that
could be the start of a tag, and the stream's pieces add up to the whole answer's fields.
"""

from __future__ import annotations

import dataclasses

from omnirelay.pipeline import REASONING_PARSERS

START, END = "<think>", "</think>"
PARSERS = REASONING_PARSERS   # vLLM's --reasoning-parser names served here


@dataclasses.dataclass(frozen=True)
class ReasoningMode:
    """How one request's output is read: ``parser`` (a :data:`PARSERS` name), whether the prompt
    already closed the reasoning, whether thinking was turned off, whether to return it."""

    parser: str
    closed_in_prompt: bool = False
    thinking_off: bool = False
    include: bool = True


def closed_in_prompt(prompt_text: str) -> bool:
    """Whether the rendered prompt's last think tag closes a block (the answer starts at once)."""
    return END in prompt_text and prompt_text.rfind(END) > prompt_text.rfind(START)


def _holdback(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class ReasoningSplitter:
    """Incremental: :meth:`feed` text pieces, then :meth:`finish`; each returns ``(reasoning, answer)``."""

    def __init__(self, mode: ReasoningMode):
        self.mode = mode
        self.in_reasoning = not mode.closed_in_prompt
        self._started = False     # a leading <think> was dropped (or can no longer come)
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", text
        self._pending += text
        reasoning = ""
        if not self._started:
            start = self._pending.find(START)
            end = self._pending.find(END)
            if start >= 0 and (end < 0 or start < end):
                reasoning, self._pending = self._pending[:start], self._pending[start + len(START):]
                self._started = True
        end = self._pending.find(END)
        if end >= 0:
            reasoning += self._pending[:end]
            answer, self._pending = self._pending[end + len(END):], ""
            self.in_reasoning = False
            return reasoning, answer
        keep = max(_holdback(self._pending, END), 0 if self._started else _holdback(self._pending, START))
        reasoning += self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """The end of the output: a tail held back is reasoning; with no ``</think>`` at all and
        thinking turned off (qwen3), what was reasoning is the answer (see :func:`split_whole`)."""
        rest, self._pending = self._pending, ""
        return (rest, "") if self.in_reasoning else ("", rest)


def split_whole(mode: ReasoningMode, text: str) -> tuple[str, str]:
    """``(reasoning, answer)`` of a whole output."""
    splitter = ReasoningSplitter(mode)
    reasoning, answer = splitter.feed(text)
    more, tail = splitter.finish()
    reasoning, answer = reasoning + more, answer + tail
    if splitter.in_reasoning and mode.thinking_off and mode.parser == "qwen3":
        return "", text   # never closed, thinking off: the model answered without thinking
    return reasoning, answer


class ReasoningFormat:
    """A chat renderer (gateway/routes/completions.py's ChatFormat, or tool_calls' wrapper of it) for
    a model with a reasoning parser: the inner format renders the answer, this adds ``reasoning``.
    One instance per choice (the stream's splitter lives in it).

    Streaming with thinking turned off (qwen3) cannot know, until ``</think>`` or the end, whether
    text is reasoning; Qwen3's template closes the block in the prompt then, so the prompt decides
    (:attr:`ReasoningMode.closed_in_prompt`) and such a stream is answer from its first token."""

    def __init__(self, inner, mode: ReasoningMode):
        self.inner = inner
        self.mode = mode
        self.object_full, self.object_chunk = inner.object_full, inner.object_chunk
        self.logprobs = inner.logprobs
        self._stream = ReasoningSplitter(mode)

    def first_delta(self) -> dict | None:
        return self.inner.first_delta()

    def delta(self, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        reasoning, answer = self._stream.feed(text)
        if finish is not None:
            more, tail = self._stream.finish()
            reasoning, answer = reasoning + more, answer + tail
        out = self.inner.delta(answer, finish, logprobs)
        if reasoning and self.mode.include:
            out["delta"] = {"reasoning": reasoning, **out["delta"]}
        return out

    def full(self, text: str, finish: str, logprobs: dict | None = None) -> dict:
        reasoning, answer = split_whole(self.mode, text)
        out = self.inner.full(answer, finish, logprobs)
        message = out["message"]
        if not message.get("content"):
            message["content"] = None   # vLLM: no answer after the reasoning is null content
        message["reasoning"] = reasoning if reasoning and self.mode.include else None
        return out


def reasoning_format(inner, mode: ReasoningMode | None):
    """``inner`` for a model without a reasoning parser, else wrapped."""
    return inner if mode is None else ReasoningFormat(inner, mode)
