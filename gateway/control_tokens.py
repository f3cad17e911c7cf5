"""Control tokens in a client's text are plain text: only the chat template writes real ones.

A chat template renders the conversation to one string and the tokenizer reads every added token's
text in it (``<|im_end|>``, ``<|im_start|>``) as that token, wherever it came from; a user who types
``<|im_end|>\\n<|im_start|>system`` would open a system turn of their own. So a client's strings that
could spell a control token are marked before rendering, and what lies between the marks is tokenized
with the added tokens off (``<|im_end|>`` typed by a user is ``<``, ``|``, ``im``, … as any text),
while the template's own text around it is tokenized as before, its markers real.

Life of a chat through here (gateway/models.py ``ModelRuntime.encode_chat_prompt``)::

    messages, tools ──▶ any string that holds a control token's text, ends with the start of one or
        begins with the end of one? (the last two: a token split across strings the template joins)
        no  ──▶ render and tokenize the whole text as before (the common case: identical ids)
        yes ──▶ in each such string, every such text wrapped in START … END (private-use characters
            a client's strings are stripped of, so marks cannot be forged) ──▶ render ──▶ cut the text
            at the marks: between a START and its END → a copy of the tokenizer with added tokens
            off; the rest → the tokenizer as it is ──▶ the ids, and the text without the marks

A piece is tokenized on its own, so a merge across a mark may differ from tokenizing the whole text;
that happens only around a control token's text a client typed. A template that cuts a string
(``split``) may leave a lone mark: it is dropped, still cutting the text there, so the two sides never
join into a token.

``omni-gateway --allow-special-tokens-in-content`` keeps the old reading (every control token's text is
the token), for clients that send templated text on purpose. The ``/v1/completions`` prompt is raw model
input and is always read with its control tokens. Thread-safe: the copy with added tokens off is set up
once here and never changed, so the gateway's CPU pool may tokenize several chats at once.
"""

from __future__ import annotations

import re
from typing import Any

from tokenizers import Tokenizer

START, END = "\U000F0000", "\U000F0001"   # supplementary private use: marks a client's string in the chat
_MARKS = re.compile(f"[{START}{END}]")
_MARKED = re.compile(f"{START}([^{START}{END}]*){END}|[{START}{END}]")


class ContentTokens:
    """The control tokens of one tokenizer (its added tokens, whitespace ones aside) and how to tokenize
    a rendered chat whose client strings were marked (:meth:`mark`)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend: Tokenizer = tokenizer.backend_tokenizer
        tokens = {t.content for t in tokenizer.added_tokens_decoder.values() if t.content.strip()}
        self.control = tuple(sorted(tokens, key=len, reverse=True))
        self._spelled = re.compile("|".join(map(re.escape, self.control))) if self.control else None
        self._heads = tuple({t[:i] for t in self.control for i in range(1, len(t))})
        self._tails = tuple({t[i:] for t in self.control for i in range(1, len(t))})
        self._as_is = backend
        self._plain = Tokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True   # added tokens read as text; set once, never changed
        # What add_special_tokens puts around a text (a BOS, say), learnt once from one character.
        bare, full = backend.encode("a", add_special_tokens=False).ids, backend.encode("a").ids
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
        self._around = (full[:at], full[at + len(bare):])
        self._newline = backend.encode("\n", add_special_tokens=False).ids

    def _marked(self, text: str) -> str:
        """``text`` (a client's string) with each control token's text in it, and a piece of one at
        either edge, wrapped in START … END; marks already in it are dropped first."""
        text = self._spelled.sub(lambda m: START + m.group(0) + END, _MARKS.sub("", text))
        if not text.endswith(END):
            head = max((h for h in self._heads if text.endswith(h)), key=len, default="")
            if head:
                text = text[:-len(head)] + START + head + END
        if not text.startswith(START):
            tail = max((t for t in self._tails if text.startswith(t)), key=len, default="")
            if tail:
                text = START + tail + END + text[len(tail):]
        return text

    def needs_marks(self, text: str) -> bool:
        """``text`` spells a control token, or a piece of one at an edge (which the template could join
        with its neighbour into one)."""
        return self._spelled is not None and (self._spelled.search(text) is not None
                                              or text.endswith(self._heads) or text.startswith(self._tails))

    def mark(self, value: Any) -> tuple[Any, bool]:
        """``value`` (messages, tools: dicts, lists, strings) with the control tokens spelled in its
        strings marked (:meth:`_marked`; dict keys are left alone); and whether any was."""
        marked = False

        def walk(node: Any) -> Any:
            nonlocal marked
            if isinstance(node, str):
                if not self.needs_marks(node):
                    return node
                marked = True
                return self._marked(node)
            if isinstance(node, dict):
                return {key: walk(item) for key, item in node.items()}
            if isinstance(node, (list, tuple)):
                return [walk(item) for item in node]
            return node

        return walk(value), marked

    def encode_client_text(self, text: str) -> list[int] | None:
        """The ids of a client's bare text (no template around it: the words a speech request speaks)
        with its control tokens as plain text; None when it spells none (tokenize it as any text)."""
        return self.encode_marked(self._marked(text), False) if self.needs_marks(text) else None

    def encode_marked(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids of a chat rendered from marked strings: what lies between a START and its END as
        plain text, the rest as is. A lone mark (the template cut a string) is dropped, cutting the text
        there, so the text on its two sides cannot join into a token."""
        ids: list[int] = []
        for index, piece in enumerate(_MARKED.split(text)):   # [text, marked, text, …]; None: a lone mark
            if piece:
                ids += self._piece(self._plain if index % 2 else self._as_is, piece, first=not ids)
        if add_special_tokens:
            ids = self._around[0] + ids + self._around[1]
        return ids

    def _piece(self, backend: Tokenizer, piece: str, first: bool) -> list[int]:
        # Mid-text, after a newline: a tokenizer that prefixes a space to a text's start (SentencePiece's
        # metaspace) must not do so in the middle of the chat.
        if first:
            return backend.encode(piece, add_special_tokens=False).ids
        ids = backend.encode("\n" + piece, add_special_tokens=False).ids
        n = len(self._newline)
        return ids[n:] if ids[:n] == self._newline else backend.encode(piece, add_special_tokens=False).ids


def strip_marks(text: str) -> str:
    """A rendered chat without its marks: the text as the template wrote it."""
    return _MARKS.sub("", text)
