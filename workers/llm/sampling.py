"""The sampler shared by the prefill and decode engines (what it samples by:
:class:`~omnirelay.request_params.TextParams`, which the request carries on the bus).

Log-probabilities (``TextParams.logprobs`` >= 0): the worker that samples a token also reports
its log-probability under the model's *raw* distribution, ``log_softmax(logits)`` in float32 taken
before temperature, top-k and top-p are applied (vLLM's default, "raw logprobs"), and with
``logprobs`` = k > 0 the k most likely tokens with theirs (:func:`chosen_logprobs`). So a greedy
token's logprob is its top-1 entry, and the numbers do not depend on how the token was drawn.

Reproducibility across processes: the random stream of a seeded request is derived from
``(seed, position)``, not from a generator that lives in one process. So the token at position ``n``
is the same whichever worker samples it — prefill for the first token, decode for the rest, or a
decode worker that takes over a stream after another one died.
"""

from __future__ import annotations

import dataclasses

import torch

from omnirelay.request_params import TextParams

_SEED_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 63) - 1


def logits_for_sampling(logits: torch.Tensor, params: list[TextParams]) -> torch.Tensor:
    """``logits`` where :func:`sample` should read them: as they are
    when every row is greedy (the argmax runs on the device, one ``tolist`` brings the tokens back),
    else on the host in one copy, so random rows draw from CPU generators and a seeded request
    samples the same tokens on any device and any worker."""
    if logits.device.type == "cpu" or all(p.greedy for p in params):
        return logits
    return logits.cpu()


@dataclasses.dataclass
class SampledStep:
    """One step's sampled rows: the token, its logprobs (None where not asked) and whether the
    row's grammar reached its end with it."""

    tokens: list[int]
    logprobs: list["TokenLogprobs | None"]
    grammar_ended: list[bool]


def sample_step(logits: torch.Tensor, params: list[TextParams], histories: list, positions: list[int], *,
                processors, grammars=None, grammar_rows: list | None = None) -> SampledStep:
    """How both engines sample a step's rows of ``logits`` [B, vocab]: on the host where a row draws
    at random (:func:`logits_for_sampling`), the grammar's mask, then the logits processors over the
    rows' ``histories``, then :func:`sample` at ``positions``; the logprobs are of the raw logits."""
    logits = logits_for_sampling(logits, params)
    masked = grammars.mask(logits, grammar_rows) if grammars else logits
    tokens = sample(processors.apply(masked, params, histories), params, positions)
    ended = grammars.accept(grammar_rows, tokens) if grammars else [False] * len(tokens)
    return SampledStep(tokens, chosen_logprobs(logits, params, tokens), ended)


def _generator(seed: int, position: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(((seed & _MASK64) * _SEED_MIX + position * 0x632BE59BD9B4E019) & _MASK64)
    return gen


def sample(logits: torch.Tensor, params: list[TextParams], positions: list[int]) -> list[int]:
    """One token per row of ``logits`` [B, vocab]; ``positions`` are the absolute output positions
    being sampled (they key the random stream of seeded requests)."""
    greedy_ids = logits.argmax(dim=-1).tolist()
    out = []
    for row, (param, position) in enumerate(zip(params, positions)):
        if param.greedy:
            out.append(greedy_ids[row])
            continue
        scores = logits[row].float() / param.temperature
        if param.top_k > 0 and param.top_k < scores.shape[-1]:
            kth = torch.topk(scores, param.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if param.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = sorted_probs.cumsum(-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = cumulative - sorted_probs >= param.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        gen = _generator(param.seed, position) if param.seed is not None else None
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's raw log-probability and, when asked, the top ``k`` ``(token_id, logprob)``
    pairs of its position, most likely first."""

    logprob: float
    top: list[tuple[int, float]] = dataclasses.field(default_factory=list)


def chosen_logprobs(logits: torch.Tensor, params: list[TextParams],
                    tokens: list[int]) -> list[TokenLogprobs | None]:
    """Per row of ``logits`` [B, vocab]: the raw logprobs of ``tokens[row]`` (see the module
    docstring), or None for a row whose request did not ask. Only the rows that asked are computed,
    in one ``log_softmax`` (float32), one ``gather`` and one ``topk`` (the largest k asked; each row
    is cut to its own k), with two copies to the host (values, ids)."""
    rows = [row for row, param in enumerate(params) if param.logprobs >= 0]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return out
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen_ids = torch.tensor([tokens[row] for row in rows], dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, chosen_ids[:, None])
    # Rows naming their ids (logprob_token_ids) report those instead of a top k.
    k = max((params[row].logprobs for row in rows if not params[row].logprob_token_ids), default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1)    # k = 0: empty
    values, top_ids = torch.cat([chosen, top_values], dim=1).tolist(), top_ids.tolist()
    for i, row in enumerate(rows):
        named = params[row].logprob_token_ids
        if named:
            picked = logprobs[i].index_select(0, torch.tensor(named, dtype=torch.long, device=logits.device))
            out[row] = TokenLogprobs(values[i][0], list(zip(named, picked.tolist())))
            continue
        own = params[row].logprobs
        out[row] = TokenLogprobs(values[i][0], list(zip(top_ids[i][:own], values[i][1:own + 1])))
    return out
