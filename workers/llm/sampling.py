"""Sampling parameters and the sampler shared by the prefill and decode engines.

Log-probabilities (``SamplingParams.logprobs`` >= 0): the worker that samples a token also reports
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
import functools
import math
from typing import Any

import torch

from omnirelay.broker.protocol import MAX_TOP_LOGPROBS   # the most alternatives per position (OpenAI's limit)

_SEED_MIX = 0x9E3779B97F4A7C15
_SAMPLING_EPS = 1e-5
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
    logprobs: int = -1        # -1: none; 0: the chosen token's; k: also the top k (k <= MAX_TOP_LOGPROBS)
    # Logits processing (workers/llm/logits_processors.py, which documents the semantics and order).
    presence_penalty: float = 0.0       # [-2, 2], over output tokens
    frequency_penalty: float = 0.0      # [-2, 2], over output tokens
    repetition_penalty: float = 1.0     # (0, 100], over prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100])
    min_p: float = 0.0                  # [0, 1]
    min_tokens: int = 0                 # like max_tokens, counted from this submission's first token
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()   # empty: every token
    # The LoRA adapter ("": the base model; then absent from the wire) and its directory on the
    # worker's host ("": the worker's own --lora-modules). On the wire: "lora": name or {name, path}.
    lora: str = ""
    lora_path: str = ""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 or positive")
        if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int) \
                or not -1 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be an integer from -1 to {MAX_TOP_LOGPROBS}")
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                             ("repetition_penalty", 0.0, 100.0), ("min_p", 0.0, 1.0)):
            value = getattr(self, name)
            if not _is_number(value) or not lo <= value <= hi or (name == "repetition_penalty" and value == 0):
                raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}]"
                                 + (" and > 0" if name == "repetition_penalty" else ""))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens:
            raise ValueError("min_tokens must be an integer >= 0")
        if not all(isinstance(pair, tuple) and len(pair) == 2 and _is_token(pair[0]) and _is_number(pair[1])
                   and -100 <= pair[1] <= 100 for pair in self.logit_bias):
            raise ValueError("logit_bias must be (token id, bias in [-100, 100]) pairs")
        if not all(isinstance(word, tuple) and word and all(_is_token(t) for t in word)
                   for word in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must be non-empty sequences of token ids")
        if not all(_is_token(t) for t in (*self.allowed_token_ids, *self.stop_token_ids)):
            raise ValueError("allowed_token_ids and stop_token_ids must be token ids")

    @functools.cached_property
    def max_token_id(self) -> int:
        """The largest token id the logits processors index the logits with (-1: none). Not
        ``stop_token_ids``: an id outside the vocabulary there just never matches (and the
        ``min_tokens`` step skips it)."""
        return max((*self.allowed_token_ids, *(t for t, _ in self.logit_bias),
                    *(t for word in self.bad_words_token_ids for t in word)), default=-1)

    @functools.cached_property
    def allowed_ids(self) -> torch.Tensor:
        """``allowed_token_ids`` as a tensor, built once per request (the list may be long)."""
        return torch.tensor(self.allowed_token_ids, dtype=torch.long)

    @functools.cached_property
    def logit_bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``logit_bias`` as (token ids, biases) tensors, built once per request."""
        return (torch.tensor([t for t, _ in self.logit_bias], dtype=torch.long),
                torch.tensor([b for _, b in self.logit_bias], dtype=torch.float32))

    def check_vocab(self, vocab_size: int) -> None:
        """``ValueError`` when :attr:`max_token_id` is outside a vocabulary of ``vocab_size``."""
        if self.max_token_id >= vocab_size:
            raise ValueError(f"token id {self.max_token_id} is outside the vocabulary ({vocab_size})")

    @functools.cached_property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @functools.cached_property
    def processed(self) -> bool:
        """Whether any logits processor applies to this request (the engines' fast path skips the
        pipeline when none of a step's rows is)."""
        return bool(self.penalized or self.logit_bias or self.min_p > 0 or self.min_tokens > 0
                    or self.bad_words_token_ids or self.allowed_token_ids)

    @property
    def greedy(self) -> bool:
        # vLLM's rule: a temperature below _SAMPLING_EPS is greedy (dividing by 1e-300 would turn
        # the logits into inf and the softmax into NaN, killing the worker in multinomial).
        return self.temperature < _SAMPLING_EPS or self.top_k == 1

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> "SamplingParams":
        """The params of a ``sampling`` map; ``ValueError`` for a key that is neither a field nor
        read by another part of the worker (:data:`OTHER_SAMPLING_KEYS`), or a value of the wrong
        type (``TypeError`` / ``ValueError``), so nothing a gateway asked for is dropped silently."""
        unknown = set(raw) - _FIELDS - OTHER_SAMPLING_KEYS
        if unknown:
            raise ValueError(f"unknown sampling keys {sorted(unknown)}")
        values = {k: v for k, v in raw.items() if k in _FIELDS and k != "lora_path"}
        if isinstance(values.get("lora"), dict):
            adapter = values.pop("lora")
            if set(adapter) - {"name", "path"} or not isinstance(adapter.get("name"), str) \
                    or not isinstance(adapter.get("path", ""), str):
                raise ValueError(f"sampling key lora: expected a name or {{name, path}}, got {adapter!r}")
            values["lora"], values["lora_path"] = adapter["name"], adapter.get("path", "")
        if not isinstance(values.get("lora", ""), str):
            raise TypeError(f"sampling key lora: expected a string, got {values['lora']!r}")
        for name in ("stop_token_ids", "allowed_token_ids"):
            if name in values:
                values[name] = tuple(values[name] or ())
        if "logit_bias" in values:
            values["logit_bias"] = tuple(tuple(pair) for pair in values["logit_bias"] or ())
        if "bad_words_token_ids" in values:
            values["bad_words_token_ids"] = tuple(tuple(word) for word in values["bad_words_token_ids"] or ())
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            if _is_number(values.get(name)):
                values[name] = float(values[name])
        return cls(**values)

    def to_wire(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["allowed_token_ids"] = list(self.allowed_token_ids)
        out["logit_bias"] = [list(pair) for pair in self.logit_bias]
        out["bad_words_token_ids"] = [list(word) for word in self.bad_words_token_ids]
        del out["lora"], out["lora_path"]
        if self.lora:   # the base: the key stays off the wire, as before LoRA existed
            out["lora"] = {"name": self.lora, "path": self.lora_path} if self.lora_path else self.lora
        return out


_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# Keys of a ``sampling`` map that other parts of a worker read: speech out (workers/runtime/roles.py,
# workers/speech/role.py) and structured outputs (workers/llm/structured_output.py).
OTHER_SAMPLING_KEYS = frozenset({"audio", "audio_stream", "structured"})


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token(value: Any) -> bool:
    return _is_int(value) and value >= 0


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


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's raw log-probability and, when asked, the top ``k`` ``(token_id, logprob)``
    pairs of its position, most likely first."""

    logprob: float
    top: list[tuple[int, float]] = dataclasses.field(default_factory=list)


def chosen_logprobs(logits: torch.Tensor, params: list[SamplingParams],
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
    k = max(params[row].logprobs for row in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1)    # k = 0: empty
    values, top_ids = torch.cat([chosen, top_values], dim=1).tolist(), top_ids.tolist()
    for i, row in enumerate(rows):
        own = params[row].logprobs
        out[row] = TokenLogprobs(values[i][0], list(zip(top_ids[i][:own], values[i][1:own + 1])))
    return out
