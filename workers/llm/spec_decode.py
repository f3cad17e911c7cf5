"""Speculative decoding in the decode engine: draft by prompt lookup, verify in one batched forward.

The life of a step that speculates (the decode engine's ``step()``, ``--speculative-config``,
:mod:`omnirelay.speculative`)::

    draft: per running sequence, up to k tokens (:class:`NgramProposer` over its prompt + output;
        capped by what it may still emit and by free KV blocks)
    ──▶ verify: ONE forward of the target over the paged cache, each sequence contributing its last
        token + its drafts (1 + d query positions), logits of every position back
    ──▶ accept: per sequence, position by position, the target samples its token exactly as a
        non-speculative step would (same logits processors over the same history, same grammar
        matcher, same seeded stream at the same output position); a drafted token equal to it is
        kept and the next position is read, the first one that differs ends the row (the target's
        token is emitted in its place); all d kept: the last position's token is a bonus
    ──▶ roll back: the KV written for rejected drafts lies past the sequence's length (never read)
        and the blocks that held only rejected drafts go back to the pool.

Why this is exact. Greedy: the emitted tokens are the argmaxes a one-token-a-step decode would
take, so the text is byte-identical (up to float rounding between a batched and a one-row forward).
Sampled: a deterministic draft ``x`` is kept iff the target's draw equals it, which happens with
probability ``p_target(x)``; when it does not, the draw is distributed as ``p_target`` with ``x``
removed and renormalised. That is Leviathan et al.'s rule for a draft distribution that is a point
mass on ``x`` (accept with ``min(1, p/q) = p(x)``, else sample the residual ``max(0, p - q)``), met
with the one coupling that keeps a seeded request's stream: its token at output position ``n`` is
drawn from ``(seed, n)`` (:mod:`~omnirelay.workers.llm.sampling`) whether or not a draft was there,
so seeds reproduce, resumption on another worker stays exact, and the output equals the
non-speculative one for the same seed.

What does not speculate (it decodes one token a step, never a different answer): a step whose batch
holds a spoken reply (its hidden states are captured per fed token), a step running more
sequences than ``disable_by_batch_size``, a sequence whose lookup finds nothing.

Metrics (engine stats, exported under vLLM's names by the gateway): ``spec_decode_num_drafts``
(sequences that had a draft, per step), ``spec_decode_num_draft_tokens``,
``spec_decode_num_accepted_tokens`` and ``spec_decode_num_accepted_tokens_per_pos_<i>``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np
import torch

from omnirelay.speculative import SpeculativeConfig
from omnirelay.workers.llm.sampling import TokenLogprobs, sample_step
from omnirelay.workers.llm.stopping import finish_reason_for

ACCEPTED_PER_POS = "spec_decode_num_accepted_tokens_per_pos_"


class NgramProposer:
    """Prompt lookup: the longest suffix of the tokens (``prompt_lookup_max`` down to
    ``prompt_lookup_min`` long) that occurred earlier; the draft is what followed its most recent
    earlier occurrence. A continuation that runs into the suffix itself goes on copying with the
    same period (a sequence repeating a span of p tokens is drafted the whole k ahead)."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """At most ``min(k, limit)`` drafted tokens to follow ``tokens`` ([] when no suffix recurs)."""
        limit = min(self.k, limit)
        length = len(tokens)
        if limit <= 0 or length < self.min_n + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. length-n-1: each has at least one token after it.
            windows = np.lib.stride_tricks.sliding_window_view(arr[:length - 1], n)
            hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
            if hits.size:
                # What followed the match, then (reaching the end) the same again: period length - start.
                span = arr[int(hits[-1]) + n:].tolist()
                return [span[j % len(span)] for j in range(limit)]
        return []


@dataclasses.dataclass
class Verified:
    """One sequence's outcome of a verification: the tokens it emits (each with its output
    position, logprobs when asked and finish reason; only the last may have one) and how many
    of its drafted tokens were kept."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = dataclasses.field(default_factory=list)
    reasons: list[str] = dataclasses.field(default_factory=list)
    accepted: int = 0


class SpeculativeDecoder:
    """The decode engine's drafting and acceptance (see the module docstring); the engine owns the
    blocks, the batch and the forward. ``stats`` is the engine's counter map."""

    def __init__(self, config: SpeculativeConfig, *, stats, processors, grammars, eos_token_ids: tuple[int, ...],
                 max_model_len: int):
        self.config = config
        self.proposer = NgramProposer(config)
        self.stats = stats
        self.processors = processors
        self.grammars = grammars
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def drafts(self, running: list) -> list[list[int]] | None:
        """A draft per running sequence (``[]`` for one without), or None when this step does not
        speculate at all (see the module docstring)."""
        limit = self.config.disable_by_batch_size
        if (limit and len(running) > limit) or any(s.task.speech_inputs is not None for s in running):
            return None
        drafts = []
        for seq in running:
            # Never draft what could not be emitted: the last emitted token is the target's own.
            room = min(seq.task.params.max_tokens - len(seq.generated), self.max_model_len - seq.total_len) - 1
            drafts.append(self.proposer.propose(seq.history.context + seq.generated, room) if room > 0 else [])
        return drafts if any(drafts) else None

    def accept(self, logits: torch.Tensor, batch: list, drafts: list[list[int]],
               grammar_row: Callable) -> list[Verified]:
        """Walk the verified positions (``logits`` ``[T, vocab]``, each sequence's 1 + d rows in
        batch order) and sample each row's tokens as described in the module docstring. Each
        emitted token is appended to its sequence's ``generated`` as it is sampled (the next
        position's penalties and grammar see it); the engine does the rest of the bookkeeping."""
        starts, row = [], 0
        for draft in drafts:
            starts.append(row)
            row += 1 + len(draft)
        results = [Verified() for _ in batch]
        active = list(range(len(batch)))
        depth = 0
        while active:
            rows = torch.tensor([starts[i] + depth for i in active], dtype=torch.long, device=logits.device)
            seqs = [batch[i] for i in active]
            positions = [s.task.position_offset + len(s.generated) for s in seqs]
            sampled = sample_step(logits.index_select(0, rows), [s.task.params for s in seqs],
                                  [s.history for s in seqs], positions, processors=self.processors,
                                  grammars=self.grammars, grammar_rows=[grammar_row(s) for s in seqs])
            still = []
            for i, seq, token, position, token_logprobs, ended in zip(active, seqs, sampled.tokens, positions,
                                                                      sampled.logprobs, sampled.grammar_ended):
                seq.generated.append(token)
                reason = "stop" if ended else finish_reason_for(token, len(seq.generated), seq.total_len,
                                                                seq.task.params, self.eos_token_ids,
                                                                self.max_model_len)
                result = results[i]
                result.tokens.append(token)
                result.positions.append(position)
                result.logprobs.append(token_logprobs)
                result.reasons.append(reason)
                draft = drafts[i]
                if depth < len(draft) and token == draft[depth]:
                    result.accepted += 1
                    self.stats[f"{ACCEPTED_PER_POS}{depth}"] += 1
                    if not reason:
                        still.append(i)
            active = still
            depth += 1
        for draft, result in zip(drafts, results):
            if draft:
                self.stats["spec_decode_num_drafts"] += 1
                self.stats["spec_decode_num_draft_tokens"] += len(draft)
                self.stats["spec_decode_num_accepted_tokens"] += result.accepted
        return results
