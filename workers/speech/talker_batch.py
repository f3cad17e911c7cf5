"""What a batched talker step needs besides the model: each request's own sampling, and the KV
caches of the requests in one batch laid side by side.

A request's talker runs as transformers' ``generate`` runs it — prompt forward, sample, then one
forward per code — but its decode steps share a forward with other requests' (step_batch.py). Two
things keep the result a function of the request alone:

* :class:`RowSampler`: the request's logits processors (transformers' own classes, in ``generate``'s
  order) and its own ``torch.Generator`` seeded with the request's seed. Its draws are those
  ``torch.manual_seed(seed); generate(...)`` makes from the global stream, whatever the batch.
* :class:`BatchKV`: each request's cache is its own until it rides in a batch; then the batch's
  caches are left-padded into one ``DynamicCache`` with a padding mask, and each row's M-RoPE
  position is its own length plus its own ``rope_delta``. While the same requests ride together
  the batch cache is reused as it is; when they change, it is cut back into the rows' caches first.

Batched matmuls add in another order than a lone row's, so a request's logits in a batch can
differ from its logits alone in the last bits; where that moves a sample across a top-k/top-p
border, its codes differ from then on. The engines' determinism contract says so (engine.py).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from transformers import DynamicCache
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper)


class RowSampler:
    """One request's sampling of one head: ``generate(do_sample=True, ...)``'s processors, its generator."""

    def __init__(self, generator: torch.Generator, *, greedy: bool = False, top_k: int | None = None,
                 top_p: float = 1.0, temperature: float = 1.0, repetition_penalty: float = 1.0,
                 min_new_tokens: tuple[int, int] | None = None, suppress: list[int] | None = None,
                 device: torch.device | str = "cpu"):
        """``min_new_tokens``: (count, eos id): EOS is ruled out until ``count`` tokens were sampled
        (``seen`` holds the sampled ones only); ``greedy``: the argmax, without the warpers."""
        # The order of generate()'s _get_logits_processor: penalties and suppression, then the warpers.
        steps: list = []
        if repetition_penalty != 1.0:
            steps.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
        if min_new_tokens is not None:
            steps.append(MinNewTokensLengthLogitsProcessor(0, min_new_tokens[0], min_new_tokens[1], device=device))
        if suppress:
            steps.append(_Suppress(suppress, device))
        if not greedy:
            if temperature != 1.0:
                steps.append(TemperatureLogitsWarper(temperature))
            if top_k:
                steps.append(TopKLogitsWarper(top_k))
            if top_p < 1.0:
                steps.append(TopPLogitsWarper(top_p))
        self.steps, self.generator, self.greedy = steps, generator, greedy

    def sample(self, logits: torch.Tensor, seen: torch.Tensor) -> int:
        """One token from ``logits`` [V] (the last position's), given the ids ``seen`` [T] so far."""
        return sample_rows([self], logits[None], [seen])[0]


class _Suppress:
    """``SuppressTokensLogitsProcessor`` with its mask built once, not per call: the same scores."""

    def __init__(self, suppress: list[int], device: torch.device | str):
        self.ids = torch.tensor(sorted(set(suppress)), dtype=torch.long, device=device)
        self.mask: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.mask is None or self.mask.shape[-1] != scores.shape[-1]:
            self.mask = torch.isin(torch.arange(scores.shape[-1], device=scores.device), self.ids)
        return torch.where(self.mask, -math.inf, scores)


# Processors that read a row's own ids (so they run row by row); every other one is elementwise or
# per row on the scores alone, so running it on the whole batch gives each row's scores alone.
_READ_IDS = (RepetitionPenaltyLogitsProcessor, MinNewTokensLengthLogitsProcessor)


def sample_rows(samplers: list[RowSampler], logits: torch.Tensor, seen: list[torch.Tensor]) -> list[int]:
    """One token per row of ``logits`` [B, V]: ``samplers[i]`` with the ids ``seen[i]``, as
    ``samplers[i].sample`` would draw it, the batch's shared processing done once (the samplers of
    one batch are configured alike: one head of one model)."""
    scores = logits.to(dtype=torch.float32, copy=True)
    # Each processor called in turn: LogitsProcessorList would inspect every signature per call.
    for index, step in enumerate(samplers[0].steps):
        if isinstance(step, _READ_IDS):
            for row, sampler in enumerate(samplers):
                scores[row] = sampler.steps[index](seen[row][None], scores[row:row + 1])[0]
        else:
            scores = step(None, scores)
    if samplers[0].greedy:
        return [int(t) for t in scores.argmax(dim=-1)]
    probs = torch.nn.functional.softmax(scores, dim=-1)
    return [int(torch.multinomial(probs[row:row + 1], num_samples=1, generator=sampler.generator)[0, 0])
            for row, sampler in enumerate(samplers)]


@dataclasses.dataclass(eq=False)
class KVRow:
    """One request's talker cache between steps: its own ``cache`` (``length`` tokens), or ``None``
    while its keys and values are a row of the batch cache; M-RoPE position = length + ``rope_delta``."""
    cache: DynamicCache | None
    length: int
    rope_delta: int


class BatchKV:
    """The caches of the rows that ride one talker step, as one left-padded ``DynamicCache``."""

    def __init__(self):
        self.rows: list[KVRow] = []
        self.cache: DynamicCache | None = None
        self.width = 0        # the batch cache's length (the longest row's, plus steps taken since)

    def take(self, rows: list[KVRow]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """The batch cache of ``rows`` (in this order), the attention mask of their next step
        [B, width + 1] and their M-RoPE positions [3, B, 1]; :meth:`advance` after the forward."""
        if [id(r) for r in rows] != [id(r) for r in self.rows]:
            self.give_back()
            self._merge(rows)
        device = self._device()
        lengths = torch.tensor([r.length for r in rows], device=device)
        columns = torch.arange(self.width + 1, device=device)
        mask = (columns[None] >= self.width - lengths[:, None]).long()   # the last length+1 columns
        positions = (lengths + torch.tensor([r.rope_delta for r in rows], device=device))[None, :, None]
        return self.cache, mask, positions.expand(3, -1, -1)

    def advance(self) -> None:
        """The step's forward appended one column to every row."""
        self.width += 1
        for row in self.rows:
            row.length += 1

    def give_back(self) -> None:
        """Cut the batch cache back into each row's own (unpadded) cache."""
        if self.cache is None:
            return
        layers = [(layer.keys, layer.values) for layer in self.cache.layers]
        for index, row in enumerate(self.rows):
            own = DynamicCache()
            for layer, (keys, values) in enumerate(layers):
                own.update(keys[index:index + 1, :, self.width - row.length:].clone(),
                           values[index:index + 1, :, self.width - row.length:].clone(), layer)
            row.cache = own
        self.rows, self.cache, self.width = [], None, 0

    def clear(self) -> None:
        """Drop the batch cache: no row that rode in it is still talking."""
        self.rows, self.cache, self.width = [], None, 0

    def _merge(self, rows: list[KVRow]) -> None:
        width = max(r.length for r in rows)
        cache = DynamicCache()
        for layer in range(len(rows[0].cache.layers)):
            keys = [r.cache.layers[layer].keys for r in rows]
            values = [r.cache.layers[layer].values for r in rows]
            cache.update(_left_padded(keys, width), _left_padded(values, width), layer)
        for row in rows:
            row.cache = None
        self.rows, self.cache, self.width = list(rows), cache, width

    def _device(self) -> torch.device:
        return self.cache.layers[0].keys.device


def _left_padded(tensors: list[torch.Tensor], width: int) -> torch.Tensor:
    """[1, heads, n_i, d] each → [B, heads, width, d], each right-aligned (zeros before it)."""
    first = tensors[0]
    out = first.new_zeros((len(tensors), first.shape[1], width, first.shape[3]))
    for index, tensor in enumerate(tensors):
        out[index, :, width - tensor.shape[2]:] = tensor[0]
    return out
