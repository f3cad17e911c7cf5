"""Log-probabilities of a prompt's own tokens: vLLM's ``prompt_logprobs``, and what completions'
``echo`` with ``logprobs`` shows for the echoed prompt.

Prompt token ``i`` (``i >= 1``) gets ``log_softmax(logits at position i - 1)[token i]``, raw (before
temperature, penalties or any other logits processor, as the sampled tokens' logprobs), its rank
among the vocabulary (1 = the likeliest; ties share the better rank) and the ``k`` likeliest tokens
of that position with theirs. Token 0 has none (nothing precedes it).

The prefill engine computes them while it prefills, chunk by chunk: a forward given a
:class:`PromptCapture` names the rows of its packed tokens whose next token is a prompt token, and
:meth:`PromptCapture.read` turns those rows' final states into logits a slice of rows at a time
(:data:`ROWS_PER_SLICE`: a prompt of thousands of tokens never holds its whole ``[tokens, vocab]``
logits at once). A request asking for them takes no cached prefix (its cached tokens' logits were
never computed), as in vLLM. In-process runners only (a parallel group's ranks return the last
token's logits alone).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

ROWS_PER_SLICE = 256


@dataclasses.dataclass
class PromptCapture:
    """One forward's rows to score: ``rows`` (indices into the step's packed tokens), ``targets``
    (the prompt token that follows each row) and ``top`` (alternatives per row, the most any
    request of the step asked for). :meth:`read` fills the results, on the host, aligned with
    ``rows``."""

    rows: list[int]
    targets: list[int]
    top: int
    logprobs: list[float] = dataclasses.field(default_factory=list)
    ranks: list[int] = dataclasses.field(default_factory=list)
    top_ids: list[list[int]] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[float]] = dataclasses.field(default_factory=list)

    @classmethod
    def of_step(cls, chunks: list[tuple[list[int], int, int, "PromptLogprobs | None"]]) -> "PromptCapture | None":
        """The capture of a step whose chunks are ``(prompt ids, tokens computed before, tokens now,
        the request's PromptLogprobs or None)`` in packed order; None when no request asks."""
        rows, targets, top, start = [], [], -1, 0
        for prompt, computed, n, lp in chunks:
            if lp is not None:
                count = _scored(prompt, computed, n)
                rows += range(start, start + count)
                targets += prompt[computed + 1: computed + 1 + count]
                top = max(top, lp.k)
            start += n
        return cls(rows, targets, top) if top >= 0 else None

    def deal(self, chunks: list[tuple[list[int], int, int, "PromptLogprobs | None"]]) -> None:
        """Hand each asking request of :meth:`of_step`'s ``chunks`` its rows' results (after :meth:`read`)."""
        start = 0
        for prompt, computed, n, lp in chunks:
            if lp is not None:
                count = _scored(prompt, computed, n)
                lp.take(self, start, count)
                start += count

    def read(self, hidden: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Score the rows of ``hidden`` (``[T, hidden]``, before the final norm) with ``logits_of``
        (the model's final norm and head, float32)."""
        for start in range(0, len(self.rows), ROWS_PER_SLICE):
            rows = torch.tensor(self.rows[start:start + ROWS_PER_SLICE], dtype=torch.long, device=hidden.device)
            targets = torch.tensor(self.targets[start:start + ROWS_PER_SLICE], dtype=torch.long,
                                   device=hidden.device)
            logprobs = torch.log_softmax(logits_of(hidden.index_select(0, rows)), dim=-1)
            chosen = logprobs.gather(1, targets[:, None])[:, 0]
            ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
            self.logprobs += chosen.tolist()
            self.ranks += ranks.tolist()
            if self.top:
                values, ids = logprobs.topk(self.top, dim=-1)
                self.top_ids += ids.tolist()
                self.top_logprobs += values.tolist()


def _scored(prompt: list[int], computed: int, n: int) -> int:
    """How many of a chunk's rows a prompt token follows (all but the prompt's last token's)."""
    return min(n, len(prompt) - 1 - computed)


@dataclasses.dataclass
class PromptLogprobs:
    """One request's prompt logprobs, prompt tokens 1 … n-1 in order (``top_ids``/``top_logprobs``
    empty lists for ``k`` = 0), grown chunk by chunk."""

    k: int
    logprobs: list[float] = dataclasses.field(default_factory=list)
    ranks: list[int] = dataclasses.field(default_factory=list)
    top_ids: list[list[int]] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[float]] = dataclasses.field(default_factory=list)

    def take(self, capture: PromptCapture, start: int, count: int) -> None:
        """Append ``count`` of ``capture``'s rows from ``start`` (this request's, in its chunk)."""
        end = start + count
        self.logprobs += capture.logprobs[start:end]
        self.ranks += capture.ranks[start:end]
        for i in range(start, end):
            self.top_ids.append(capture.top_ids[i][:self.k] if self.k else [])
            self.top_logprobs.append(capture.top_logprobs[i][:self.k] if self.k else [])
