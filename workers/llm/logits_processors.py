"""The logits processing between the model's forward and the sampler: an ordered pipeline of
steps, each one batched tensor operation over the rows that ask for it.

Contract. :meth:`LogitsProcessors.apply` takes one engine step's logits ``[B, vocab]``, the rows'
:class:`~omnirelay.workers.llm.sampling.TextParams` and their :class:`TokenHistory`, and returns the
scores :func:`~omnirelay.workers.llm.sampling.sample` draws from (greedy rows take their argmax, so
these options bind greedy requests too). The input is never written: the engines compute logprobs
from the raw logits (sampling.py's documented "raw logprobs"). When no row asks for anything the
input itself comes back, with no copy and no tensor operation (the cost of the common case is one
Python pass over the rows' params). The prefill engine calls it for a request's first token and
the decode engine for the rest, so an option binds every position alike.

Order (vLLM's, so an answer matches vLLM's for the same options):

1. ``allowed_token_ids``: every other token gets -inf;
2. ``bad_words_token_ids``: a bad word's last token gets -inf where the output so far ends with the
   word's other tokens (a one-token word: always);
3. ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` get -inf while fewer than
   ``min_tokens`` tokens were generated in this submission;
4. ``logit_bias``: added to the logits of its tokens;
5. penalties: ``repetition_penalty`` divides the positive and multiplies the negative logits of
   every token of prompt or output; ``frequency_penalty`` × (the token's count in the output) and
   ``presence_penalty`` × (1 if it is in the output) are subtracted (both over output tokens only);
6. ``min_p``: tokens whose probability after temperature is below ``min_p`` × the row's largest
   are dropped (random rows only: it cannot change a greedy row's argmax).

Temperature, top-k and top-p then run in the sampler. A grammar's token bitmask (structured
outputs) is a step *before* this pipeline, as vLLM applies it before its sampler: it is the
pipeline's input, so the guard below never undoes it. Guard: a row the options leave without
any token (say ``allowed_token_ids`` holding only EOS under ``min_tokens``) gets its input row back
rather than failing the batch on an all -inf row.

Output tokens and resumes. The frequency, presence and bad-word steps look at the request's
output, the repetition penalty at prompt and output. A stream resumed on another worker arrives
with the tokens the client already has appended to its prompt (``position_offset`` of them), so
:class:`TokenHistory` splits ``context`` there: whichever worker samples a position sees the same
prompt and output, and the options bind as if one worker had run the whole answer. ``min_tokens``,
like ``max_tokens``, counts from the submission's first token (the gateway subtracts what the
client already has).
"""

from __future__ import annotations

import dataclasses

import torch

from omnirelay.request_params import TextParams

_NEG_INF = float("-inf")
MAX_LOGIT = 1e4   # the largest score a penalty may leave (see _penalties)


@dataclasses.dataclass
class TokenHistory:
    """The tokens before the position being sampled: ``context`` (the task's prompt, whose last
    ``resumed`` ids are output tokens the client already has) then ``generated`` (this worker's
    output so far, a list the engine appends to: the history stays current without rebuilding)."""

    context: list[int]
    resumed: int = 0
    generated: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_generated(self) -> int:
        """Output tokens of this submission (``min_tokens`` counts these)."""
        return len(self.generated)

    def output(self) -> list[int]:
        """Every output token so far, the resumed ones first."""
        start = len(self.context) - self.resumed
        return self.context[start:] + self.generated

    def output_tail(self, n: int) -> list[int]:
        """The last ``n`` output tokens (fewer when the output is shorter)."""
        if n <= len(self.generated):
            return self.generated[len(self.generated) - n:]
        start = max(len(self.context) - self.resumed, len(self.context) - (n - len(self.generated)))
        return self.context[start:] + self.generated


class LogitsProcessors:
    """The pipeline of one engine. ``eos_token_ids``: the model's, masked by ``min_tokens``."""

    def __init__(self, eos_token_ids: tuple[int, ...]):
        self.eos_token_ids = tuple(eos_token_ids)

    def apply(self, logits: torch.Tensor, params: list[TextParams],
              histories: list[TokenHistory]) -> torch.Tensor:
        """The scores to sample row ``i`` from, given ``params[i]`` and ``histories[i]`` (see the
        module docstring); ``logits`` itself when no row asks for any option."""
        rows = [i for i, p in enumerate(params) if p.processed]
        if not rows:
            return logits
        out = logits.to(torch.float32, copy=True)
        device = out.device
        _allowed(out, [i for i in rows if params[i].allowed_token_ids], params, device)
        _bad_words(out, [i for i in rows if params[i].bad_words_token_ids], params, histories, device)
        self._min_tokens(out, [i for i in rows if histories[i].num_generated < params[i].min_tokens], params)
        _logit_bias(out, [i for i in rows if params[i].logit_bias], params, device)
        _penalties(out, [i for i in rows if params[i].penalized], params, histories, device)
        _min_p(out, [i for i in rows if params[i].min_p > 0 and not params[i].greedy], params, device)
        # Only masking options can leave a row without tokens (penalties and biases stay finite).
        masking = [i for i in rows if params[i].allowed_token_ids or params[i].bad_words_token_ids
                   or params[i].min_tokens or params[i].min_p > 0]
        if masking:
            index = torch.tensor(masking, dtype=torch.long, device=device)
            dead = torch.isneginf(out.index_select(0, index).amax(dim=-1))
            keep = torch.where(dead[:, None], logits.index_select(0, index).float(), out.index_select(0, index))
            out.index_copy_(0, index, keep)
        return out

    def _min_tokens(self, out: torch.Tensor, rows: list[int], params: list[TextParams]) -> None:
        vocab = out.shape[-1]
        pairs = [(i, t) for i in rows for t in
                 (params[i].stop_token_ids if params[i].ignore_eos else self.eos_token_ids + params[i].stop_token_ids)
                 if t < vocab]
        _fill(out, pairs, _NEG_INF)


def _fill(out: torch.Tensor, pairs: list[tuple[int, int]], value: float) -> None:
    """``out[row, token] = value`` for every pair, in one ``index_put_``."""
    if pairs:
        index = torch.tensor(pairs, dtype=torch.long, device=out.device).T
        out.index_put_((index[0], index[1]), torch.tensor(value, device=out.device))


def _allowed(out: torch.Tensor, rows: list[int], params: list[TextParams], device: torch.device) -> None:
    """Rows with ``allowed_token_ids``: -inf everywhere but those tokens (one mask, one fill)."""
    if not rows:
        return
    ids = [params[i].allowed_ids for i in rows]
    local = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(t) for t in ids])).to(device)
    banned = torch.ones(len(rows), out.shape[-1], dtype=torch.bool, device=device)
    banned.index_put_((local, torch.cat(ids).to(device)), torch.tensor(False, device=device))
    index = torch.tensor(rows, dtype=torch.long, device=device)
    out.index_copy_(0, index, out.index_select(0, index).masked_fill_(banned, _NEG_INF))


def _bad_words(out: torch.Tensor, rows: list[int], params: list[TextParams], histories: list[TokenHistory],
               device: torch.device) -> None:
    """Every (row, bad word) pair at once: the word's leading tokens, right-aligned and padded
    with -1, are compared with the row's last output tokens (padded with -2, which matches
    nothing); a match bans the word's last token."""
    if not rows:
        return
    words = [(i, word) for i in rows for word in params[i].bad_words_token_ids]
    width = max(len(word) for _, word in words) - 1
    prefixes = [[-1] * (width - len(word) + 1) + list(word[:-1]) for _, word in words]
    tails = {i: histories[i].output_tail(width) if width else [] for i in rows}
    padded = [[-2] * (width - len(tails[i])) + tails[i] for i, _ in words]
    prefix = torch.tensor(prefixes, dtype=torch.long, device=device).reshape(len(words), width)
    tail = torch.tensor(padded, dtype=torch.long, device=device).reshape(len(words), width)
    match = ((prefix == tail) | (prefix < 0)).all(dim=1)
    row = torch.tensor([i for i, _ in words], dtype=torch.long, device=device)
    last = torch.tensor([word[-1] for _, word in words], dtype=torch.long, device=device)
    # Adding 0 or -inf (accumulate) lets two words ending in the same token coexist.
    out.index_put_((row, last), torch.where(match, _NEG_INF, 0.0).to(out.dtype), accumulate=True)


def _logit_bias(out: torch.Tensor, rows: list[int], params: list[TextParams], device: torch.device) -> None:
    if not rows:
        return
    tensors = [params[i].logit_bias_tensors for i in rows]
    row = torch.repeat_interleave(torch.tensor(rows), torch.tensor([len(t) for t, _ in tensors])).to(device)
    tokens = torch.cat([t for t, _ in tensors]).to(device)
    values = torch.cat([b for _, b in tensors]).to(device=device, dtype=out.dtype)
    out.index_put_((row, tokens), values, accumulate=True)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """One value per row, as a ``[R, 1]`` column on ``like``'s device and dtype."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


def _penalties(out: torch.Tensor, rows: list[int], params: list[TextParams], histories: list[TokenHistory],
               device: torch.device) -> None:
    """vLLM's ``apply_penalties`` over the rows that set any penalty, computed only where it can
    change anything: at the distinct (row, token) pairs of the rows' prompts and outputs (a few
    hundred per row, not the vocabulary). One ``unique`` finds the pairs and each token's output
    count, one gather reads their logits, three elementwise updates and one scatter write them back."""
    vocab = out.shape[-1]
    outputs = [histories[i].output() for i in rows]
    prompts = [histories[i].context[:len(histories[i].context) - histories[i].resumed] for i in rows]
    out_keys = torch.tensor([j * vocab + t for j, ids in enumerate(outputs) for t in ids], dtype=torch.long)
    prompt_keys = torch.tensor([j * vocab + t for j, ids in enumerate(prompts) for t in ids], dtype=torch.long)
    keys, inverse = torch.unique(torch.cat([out_keys, prompt_keys]), return_inverse=True)
    counts = torch.zeros(len(keys), dtype=out.dtype).index_add_(
        0, inverse[:len(out_keys)], torch.ones(len(out_keys), dtype=out.dtype))
    keys, counts = keys.to(device), counts.to(device)
    local, token = keys // vocab, keys % vocab
    row = torch.tensor(rows, dtype=torch.long, device=device)[local]
    # (float32 has no 5e-324: kept above zero, or -inf × 0 would be NaN)
    repetition = torch.tensor([params[i].repetition_penalty for i in rows], dtype=out.dtype,
                              device=device).clamp_(min=torch.finfo(out.dtype).tiny)[local]
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], dtype=out.dtype, device=device)[local]
    presence = torch.tensor([params[i].presence_penalty for i in rows], dtype=out.dtype, device=device)[local]
    values = out[row, token]
    # A tiny repetition_penalty would divide a positive logit past the float range: +inf there makes
    # the sampler's softmax NaN. Capped (ties among such tokens are the only cost); -inf stays -inf.
    values = torch.where(values > 0, values / repetition, values * repetition).clamp_(max=MAX_LOGIT)
    out[row, token] = values - frequency * counts - presence * (counts > 0).to(out.dtype)


def _min_p(out: torch.Tensor, rows: list[int], params: list[TextParams], device: torch.device) -> None:
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.long, device=device)
    temperature = _column([params[i].temperature for i in rows], out)
    min_p = _column([params[i].min_p for i in rows], out)
    scores = out.index_select(0, index)
    probs = torch.softmax(scores / temperature, dim=-1)
    drop = probs < probs.amax(dim=-1, keepdim=True) * min_p
    out.index_copy_(0, index, scores.masked_fill_(drop, _NEG_INF))

