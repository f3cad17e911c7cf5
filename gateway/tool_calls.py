"""Tool calls in a chat answer: the model's text → OpenAI's ``message.tool_calls`` and stream deltas.

:func:`chat_format` wraps the chat renderer of gateway/routes/completions.py for a request with tools
(gateway/structured.py :class:`~omnirelay.gateway.structured.ToolsRequest`); its ``delta`` (one per
streamed text piece) and ``full`` (the whole text) run the same incremental parser, so a streamed
answer carries the same content and calls as the whole one:

* ``auto``: the model's markup (its ``--tool-call-parser``: gateway/tool_call_formats.py), Hermes/Qwen's
  ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` by default, Qwen3-Coder's
  ``<tool_call><function=…><parameter=…>…</parameter></function></tool_call>`` with ``qwen3_coder``. Text
  outside the markup is ``content`` (streamed as it comes, holding back only what could be the start
  of ``<tool_call>``); each complete call becomes one ``tool_calls`` entry, streamed as one delta
  when its closing tag arrives. Markup that does not hold a call to one of the tools (bad JSON, an
  unknown name) or is never closed stays content. ``parallel_tool_calls: false`` keeps the first call.
* ``required``: the answer was constrained to ``{"name", "arguments"}``: one call, sent whole at the end
  (cut short by max_tokens: the call with its arguments as far as they got, once its name is whole).
* named: the answer was constrained to the arguments: the call's first delta names the function
  and each later text piece extends its ``arguments``; an answer cut before its arguments say more
  than ``{`` has no call (as vLLM).

Arguments are a JSON string, as OpenAI sends them (``auto``/``required``: the parsed object
re-serialised; named: the model's text as generated). An answer with calls finishes with
``"tool_calls"`` (a truncated one keeps ``"length"``); ``content`` is null when only whitespace
surrounds the calls.
"""

from __future__ import annotations

import json
import re
import uuid

from .structured import ToolsRequest
from .tool_call_formats import DEFAULT_TOOL_CALL_PARSER, PARSE_BLOCK, parse_hermes

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The start of a required call as its grammar writes it (name first; tool names need no escapes).
_CUT_REQUIRED = re.compile(r'\{\s*"name"\s*:\s*"(?P<name>[A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?P<arguments>.*)\Z',
                           re.DOTALL)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(text: str, names: set[str]) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a call object's text, or None if it is not a call to a tool."""
    calls = parse_hermes(text, dict.fromkeys(names, {}))
    return calls[0] if calls else None


class ToolCallParser:
    """Incremental: :meth:`feed` text pieces, then :meth:`finish`; each returns ``(content, calls)``
    with ``calls`` as OpenAI's stream entries (``index``, ``id``, ``type``, ``function``).
    ``markup``: the model's ``--tool-call-parser`` (gateway/tool_call_formats.py), how an ``auto``
    answer writes a call inside its tags."""

    def __init__(self, tools: ToolsRequest, markup: str = DEFAULT_TOOL_CALL_PARSER):
        self.tools = tools
        self.names = {t["function"]["name"] for t in tools.tools}
        self._functions = {t["function"]["name"]: t["function"] for t in tools.tools}
        self._parse_block = PARSE_BLOCK[markup]
        self.num_calls = 0
        self._pending = ""      # auto: text not yet given out; required: everything so far
        self._named_id = ""

    def _call(self, name: str, arguments: str) -> dict:
        entry = {"index": self.num_calls, "id": _call_id(), "type": "function",
                 "function": {"name": name, "arguments": arguments}}
        self.num_calls += 1
        return entry

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.tools.choice == "named":
            if not self._named_id:
                # Held back until the arguments say more than "{": an answer cut there has no call (vLLM).
                self._pending += text
                if self._pending.strip() in ("", "{"):
                    return "", []
                self._named_id = _call_id()
                self.num_calls = 1
                arguments, self._pending = self._pending, ""
                return "", [{"index": 0, "id": self._named_id, "type": "function",
                             "function": {"name": self.tools.name, "arguments": arguments}}]
            return "", ([{"index": 0, "function": {"arguments": text}}] if text else [])
        self._pending += text
        if self.tools.choice == "required":
            return "", []
        content, calls = [], []
        while True:
            start = self._pending.find(OPEN)
            if start < 0:
                # Hold back a tail that may be the start of the opening tag.
                keep = next((k for k in range(min(len(OPEN) - 1, len(self._pending)), 0, -1)
                             if OPEN.startswith(self._pending[-k:])), 0)
                content.append(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            end = self._pending.find(CLOSE, start)
            if end < 0:
                content.append(self._pending[:start])
                self._pending = self._pending[start:]
                break
            parsed = self._parse_block(self._pending[start + len(OPEN):end], self._functions)
            if parsed is None:
                content.append(self._pending[:end + len(CLOSE)])
            else:
                content.append(self._pending[:start])
                for call in parsed:
                    if self.tools.parallel or not self.num_calls:
                        calls.append(self._call(*call))
            self._pending = self._pending[end + len(CLOSE):]
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict]]:
        """The rest at the end of the answer: an unclosed call stays content."""
        if self.tools.choice == "named":
            self._pending = ""   # at most "{": the answer was cut before its arguments began
            return "", []
        rest, self._pending = self._pending, ""
        if self.tools.choice == "required":
            try:
                call = json.loads(rest)
            except ValueError:
                return self._cut_call(rest)
            parsed = parse_call(rest, self.names) if isinstance(call, dict) else None
            return ("", [self._call(*parsed)]) if parsed else (rest, [])
        return rest, []

    def _cut_call(self, rest: str) -> tuple[str, list[dict]]:
        """A ``required`` answer cut short (max_tokens): the grammar wrote ``{"name":"…","arguments":``
        first, so once the name is whole the call is returned with its arguments as far as they got,
        as a named choice's cut answer is; before that (or past a "{"), no call."""
        match = _CUT_REQUIRED.match(rest)
        if match is None or match.group("name") not in self.names or match.group("arguments").strip() in ("", "{"):
            return "", []
        return "", [self._call(match.group("name"), match.group("arguments"))]


class ToolCallFormat:
    """gateway/routes/completions.py's chat format for a request with tools: the same ``first_delta``, ``delta``,
    ``full`` and ``logprobs`` as the plain one, with content and calls split by a
    :class:`ToolCallParser`. One instance per request (the stream's parser lives in it)."""

    def __init__(self, base, tools: ToolsRequest, markup: str = DEFAULT_TOOL_CALL_PARSER):
        self.base = base
        self.tools = tools
        self.markup = markup
        self.object_full, self.object_chunk = base.object_full, base.object_chunk
        self.logprobs = base.logprobs
        self._stream = ToolCallParser(tools, markup)

    def first_delta(self) -> dict | None:
        return self.base.first_delta()

    @staticmethod
    def _finish(finish: str | None, num_calls: int) -> str | None:
        return "tool_calls" if finish == "stop" and num_calls else finish

    def delta(self, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        content, calls = self._stream.feed(text)
        if finish is not None:
            tail, more = self._stream.finish()
            content, calls = content + tail, calls + more
        delta: dict = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return {"index": 0, "delta": delta, "logprobs": logprobs,
                "finish_reason": self._finish(finish, self._stream.num_calls)}

    def full(self, text: str, finish: str, logprobs: dict | None = None) -> dict:
        parser = ToolCallParser(self.tools, self.markup)
        content, calls = parser.feed(text)
        tail, more = parser.finish()
        content, calls = content + tail, calls + more
        message: dict = {"role": "assistant", "content": content, "reasoning": None}
        if calls:
            message["tool_calls"] = calls
            if not content.strip():
                message["content"] = None
        return {"index": 0, "message": message, "logprobs": logprobs,
                "finish_reason": self._finish(finish, len(calls))}


def chat_format(base, tools: ToolsRequest | None, markup: str = DEFAULT_TOOL_CALL_PARSER):
    """``base`` for a request without tools (or ``tool_choice: "none"``), else its tool-call form
    reading ``markup`` (the model's ``--tool-call-parser``)."""
    if tools is None or tools.choice == "none":
        return base
    return ToolCallFormat(base, tools, markup)
