"""Sampling parameters and the sampler shared by the prefill and decode engines.

Reproducibility across processes: the random stream of a seeded request is derived from
``(seed, position)``, not from a generator that lives in one process. So the token at position ``n``
is the same whichever worker samples it — prefill for the first token, decode for the rest, or a
decode worker that takes over a stream after another one died.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

_SEED_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 63) - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Validated on construction; built from the ``sampling`` map of a bus message."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0 or -1: disabled
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 or positive")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> "SamplingParams":
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        if "stop_token_ids" in values:
            values["stop_token_ids"] = tuple(int(t) for t in values["stop_token_ids"] or ())
        return cls(**values)

    def to_wire(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["stop_token_ids"] = list(self.stop_token_ids)
        return out


def _generator(seed: int, position: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(((seed & _MASK64) * _SEED_MIX + position * 0x632BE59BD9B4E019) & _MASK64)
    return gen


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
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
