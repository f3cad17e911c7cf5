"""A Responses answer's output items and its typed stream events, built from the chat path's text.

:class:`OutputBuilder` is fed the answer's text chunks (gateway/generation.py ``TextChunk``) and
returns, per chunk, the stream events they make (OpenAI's ``response.*`` types, without
``sequence_number``, which the writer numbers). The same builder makes the non-streamed answer (its
events are dropped), so both carry the same items. Items, in order of appearance:

* ``message``: assistant text, one ``output_text`` part (with ``logprobs`` when asked). Events:
  ``response.output_item.added`` → ``response.content_part.added`` → ``response.output_text.delta``
  per piece → ``response.output_text.done`` → ``response.content_part.done`` →
  ``response.output_item.done``.
* ``reasoning`` (a model served with a reasoning parser, gateway/reasoning.py): the ``<think>``
  text, one ``reasoning_text`` part. Events: ``response.output_item.added`` →
  ``response.content_part.added`` → ``response.reasoning_text.delta`` per piece →
  ``response.reasoning_text.done`` → ``response.content_part.done`` → ``response.output_item.done``.
  The answer after it (text and tool calls) is read as below; ``usage.output_tokens_details.
  reasoning_tokens`` counts the output tokens up to the one that closes the reasoning.
* ``function_call``: a tool call found by gateway/tool_calls.py's :class:`ToolCallParser` (``auto``:
  the model's markup, ``required``: the whole constrained call at the end, named: arguments as they come).
  Events: ``response.output_item.added`` (arguments "") → ``response.function_call_arguments.delta``
  → ``response.function_call_arguments.done`` → ``response.output_item.done``.

With tools, text that is only whitespace between calls makes no message item (chat answers such
content as null); an answer with no item at all still gets its (possibly empty) message. A cut at
``max_output_tokens`` leaves the last item ``incomplete``.
"""

from __future__ import annotations

import re
import uuid

from . import generation
from .reasoning import END, ReasoningMode, ReasoningSplitter
from .structured import ToolsRequest
from .tool_call_formats import DEFAULT_TOOL_CALL_PARSER
from .tool_calls import ToolCallParser


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """``logprobs``: render each text piece's token logprobs (no tools then: schema checks it)."""

    def __init__(self, gen: generation.Generation, tools: ToolsRequest | None, logprobs: bool, render_logprobs,
                 reasoning: ReasoningMode | None = None, markup: str = DEFAULT_TOOL_CALL_PARSER):
        """``markup``: the model's ``--tool-call-parser`` (gateway/tool_call_formats.py)."""
        self.gen = gen
        self.parser = ToolCallParser(tools, markup) if tools is not None and tools.choice != "none" else None
        self.splitter = ReasoningSplitter(reasoning) if reasoning is not None else None
        self.reasoning_tokens = 0
        self._generated: list[int] = []     # while reasoning: the output's ids so far
        self.logprobs = logprobs
        self._render_logprobs = render_logprobs   # completions.ChatFormat.logprobs
        self.items: list[dict] = []
        self._open: dict | None = None      # the item being written
        self._held = ""                    # whitespace held back while tools may still call
        self._calls: dict[int, dict] = {}  # parser call index → its item

    # ------------------------------------------------------------------ feeding

    def feed(self, chunk: generation.TextChunk) -> list[dict]:
        """Events for one chunk of the answer (the last one has ``finish_reason``)."""
        events: list[dict] = []
        logprobs = []
        if self.logprobs and chunk.token_ids:
            logprobs = self._render_logprobs(self.gen, chunk.token_ids, chunk.logprobs, 0)[0]["content"]
        text = chunk.text
        if self.splitter is not None:
            text, reasoning_events = self._split(chunk)
            events += reasoning_events
        if self.parser is None:
            if text or logprobs:
                events += self._text(text, logprobs)
        else:
            # Fed up to each '>' at a time: one feed then returns its text before the call it closes,
            # so the items keep the answer's order (the parser returns a feed's text and calls apart).
            for piece in re.split(r"(?<=>)", text):
                if piece:
                    events += self._tool_output(*self.parser.feed(piece))
            if chunk.finish_reason:
                events += self._tool_output(*self.parser.finish())
        if chunk.finish_reason:
            events += self.finish(chunk.finish_reason)
        return events

    def finish(self, finish_reason: str) -> list[dict]:
        """Close the open item (``incomplete`` when cut at the token limit)."""
        events: list[dict] = []
        if not self.items:   # an answer with nothing in it still has its message
            events += self._text(self._held, [])
            self._held = ""
        return events + self._close("incomplete" if finish_reason == "length" else "completed")

    @property
    def incomplete(self) -> bool:
        return any(item.get("status") == "incomplete" for item in self.items)

    def _split(self, chunk: generation.TextChunk) -> tuple[str, list[dict]]:
        """The chunk's answer text, and the events of its reasoning."""
        was_reasoning = self.splitter.in_reasoning
        reasoning, answer = self.splitter.feed(chunk.text)
        if chunk.finish_reason:
            more, tail = self.splitter.finish()
            reasoning, answer = reasoning + more, answer + tail
        if was_reasoning:
            self._generated += chunk.token_ids
            if self.splitter.in_reasoning:
                self.reasoning_tokens = len(self._generated)
            else:   # closed in this chunk: count up to the token that completes the tag
                start = len(self._generated) - len(chunk.token_ids)
                self.reasoning_tokens = next((k for k in range(start + 1, len(self._generated) + 1)
                                              if END in self.gen.model.tokenizer.decode(self._generated[:k])),
                                             len(self._generated))
                self._generated = []
        events: list[dict] = []
        if reasoning:
            if self._open is None or self._open["type"] != "reasoning":
                events += self._close("completed")
                item = {"id": _item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                        "content": [], "encrypted_content": None}
                events += self._add(item)
                part = {"type": "reasoning_text", "text": ""}
                item["content"].append(part)
                events.append({"type": "response.content_part.added", "item_id": item["id"],
                               "output_index": len(self.items) - 1, "content_index": 0, "part": dict(part)})
            item = self._open
            item["content"][0]["text"] += reasoning
            events.append({"type": "response.reasoning_text.delta", "item_id": item["id"],
                           "output_index": len(self.items) - 1, "content_index": 0, "delta": reasoning})
        return answer, events

    # ------------------------------------------------------------------ items

    def _tool_output(self, content: str, calls: list[dict]) -> list[dict]:
        events: list[dict] = []
        if content:
            if content.strip() or (self._open is not None and self._open["type"] == "message"):
                events += self._text(self._held + content, [])
                self._held = ""
            else:
                self._held += content
        for call in calls:
            function = call.get("function", {})
            item = self._calls.get(call["index"])
            if item is None:
                self._held = ""
                events += self._close("completed")
                item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress",
                        "call_id": call["id"], "name": function["name"], "arguments": ""}
                self._calls[call["index"]] = item
                events += self._add(item)
            delta = function.get("arguments", "")
            if delta:
                item["arguments"] += delta
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": self.items.index(item), "delta": delta})
        return events

    def _text(self, text: str, logprobs: list) -> list[dict]:
        events: list[dict] = []
        if self._open is None or self._open["type"] != "message":
            events += self._close("completed")
            item = {"id": _item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            events += self._add(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": len(self.items) - 1, "content_index": 0, "part": dict(part)})
        item = self._open
        part = item["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        if text or logprobs:
            events.append({"type": "response.output_text.delta", "item_id": item["id"],
                           "output_index": len(self.items) - 1, "content_index": 0, "delta": text,
                           "logprobs": logprobs})
        return events

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self._open = item
        shown = {**item, "content": []} if "content" in item else dict(item)
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": shown}]

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = status
        base = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            events = [{"type": "response.output_text.done", **base, "content_index": 0, "text": part["text"],
                       "logprobs": part["logprobs"]},
                      {"type": "response.content_part.done", **base, "content_index": 0, "part": dict(part)}]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events = [{"type": "response.reasoning_text.done", **base, "content_index": 0, "text": part["text"]},
                      {"type": "response.content_part.done", **base, "content_index": 0, "part": dict(part)}]
        else:
            events = [{"type": "response.function_call_arguments.done", **base, "arguments": item["arguments"]}]
        return events + [{"type": "response.output_item.done", "output_index": index, "item": _copy(item)}]


def _copy(item: dict) -> dict:
    if "content" in item:
        return {**item, "content": [dict(part) for part in item["content"]]}
    return dict(item)


def output_messages(items: list[dict]) -> list[dict]:
    """The answer's items as chat messages, for the stored conversation: the text and the calls
    of one turn in one assistant message."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"] or "{}"}}
             for item in items if item["type"] == "function_call"]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
