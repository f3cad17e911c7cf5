"""Prefill's pooling of one prompt into one vector (``PoolingParams``: ``/v1/embeddings``).

A pooling request runs through the prefill engine like any prompt, chunk by chunk; each forward it
joins leaves the final-norm hidden states of its tokens (``HiddenCapture``), which the request's
:class:`PoolAccumulator` reduces as they pass, so no prompt's states are held whole:

    admit ──▶ forward × k: :meth:`PoolAccumulator.add` (last: the last token's row once it runs;
    mean: a running float64 sum; cls: row 0) ──last chunk──▶ :meth:`PoolAccumulator.finish`:
    the vector, truncated to ``dimensions``, L2-normalised when asked, as little-endian float32 bytes

Last-token pooling may take a cached prefix (the last token is always computed); mean and CLS need
every token's state, so such a request takes none (``PoolingParams.needs_every_token``).
"""

from __future__ import annotations

import torch

from omnirelay.pooling_params import PoolingParams


class PoolAccumulator:
    """The pooling of one prompt of ``num_tokens`` tokens, fed each forward's rows in order."""

    def __init__(self, params: PoolingParams, num_tokens: int):
        self.params = params
        self.num_tokens = num_tokens
        self._pooled: torch.Tensor | None = None   # last / cls: the row; mean: the running sum
        self._count = 0

    def add(self, states: torch.Tensor, start: int) -> None:
        """``states``: ``[n, hidden]`` final-norm states of prompt positions ``start .. start + n - 1``."""
        n = states.shape[0]
        kind = self.params.pooling
        if self.params.label_token_ids:
            return   # scored from the logits (add_logits), not the states
        if kind == "last":
            if start + n == self.num_tokens:
                self._pooled = states[-1].to(torch.float64, copy=True)
        elif kind == "cls":
            if start == 0:
                self._pooled = states[0].to(torch.float64, copy=True)
        else:
            total = states.to(torch.float64).sum(dim=0)
            self._pooled = total if self._pooled is None else self._pooled + total
            self._count += n

    def add_logits(self, logits: torch.Tensor) -> None:
        """The last prompt token's logits ``[vocab]``: a reranker's result is the softmax over its
        ``label_token_ids`` (Qwen3-Reranker: (no, yes), the last value the relevance)."""
        if self.params.label_token_ids:
            picked = logits[list(self.params.label_token_ids)].to("cpu", torch.float64)
            self._pooled = torch.softmax(picked, dim=0)

    @property
    def wants_logits(self) -> bool:
        return bool(self.params.label_token_ids)

    def finish(self) -> bytes:
        """The pooled vector (``dimensions`` first, then ``normalize``) as little-endian float32; a
        reranker's label probabilities as they are."""
        if self.params.label_token_ids:
            if self._pooled is None:
                raise RuntimeError("a reranker's request finished before its last token's logits")
            return self._pooled.to(torch.float32).numpy().astype("<f4", copy=False).tobytes()
        if self._pooled is None or (self.params.pooling == "mean" and self._count != self.num_tokens):
            raise RuntimeError("pooling finished before every token it pools was computed")
        vector = self._pooled / self._count if self.params.pooling == "mean" else self._pooled
        if self.params.dimensions:
            vector = vector[: self.params.dimensions]
        if self.params.normalize:
            vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
        return vector.to(torch.float32).numpy().astype("<f4", copy=False).tobytes()
