"""The sampling options beyond temperature/top-p/top-k: parsed from the request body, checked
against the model (vocabulary, tokenizer) and turned into ``sampling`` keys for the workers.

Options (vLLM's names and semantics; the worker side and the order they apply in are documented
in workers/llm/logits_processors.py):

=====================  =================================================  ========================
option                 accepted                                           wire key (``sampling``)
=====================  =================================================  ========================
presence_penalty       number in [-2, 2]                                  presence_penalty
frequency_penalty      number in [-2, 2]                                  frequency_penalty
repetition_penalty     number in (0, 100]                                 repetition_penalty
logit_bias             {"token id": bias in [-100, 100]}, ids in vocab    logit_bias [[id, bias]…]
min_p                  number in [0, 1]                                   min_p
min_tokens             integer >= 0, at most max_tokens                   min_tokens (per submission)
bad_words              list of non-empty strings, tokenized here          bad_words_token_ids
allowed_token_ids      non-empty list of ids in vocab                     allowed_token_ids
=====================  =================================================  ========================

Every check raises :class:`~omnirelay.errors.BadRequest` naming the option, before anything is
submitted. An option at its neutral value is not sent at all. ``min_tokens`` counts output
tokens like ``max_tokens``: a resumed submission carries what is left of it
(:func:`submission_min_tokens`), and stop strings only end the answer after it
(:class:`~omnirelay.gateway.detokenizer.IncrementalDetokenizer`).

``bad_words`` follow vLLM: each word is banned as tokenized on its own and, where that tokenizes
differently in its first token (but into as many tokens), also with a leading space, so the word
is banned both at the start of the text and after a space.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from omnirelay.errors import BadRequest

MAX_LOGIT_BIAS = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_BAD_WORDS = 128


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None   # None: every token


def out_of_range(name: str, value, lo=None, hi=None, *, open_low: bool = False) -> BadRequest:
    """The 400 for ``value`` of ``name`` outside [lo, hi] (either bound may be None: none), worded
    as vLLM's pydantic validation words it too (``greater_than_equal``/``less_than_equal``, the
    ``greater_than`` of an open bound), which vLLM's clients and tests match."""
    def shown(x) -> str:
        return f"{x:g}" if isinstance(x, float) else str(x)

    if lo is not None and hi is not None:
        bounds = f"in {'(' if open_low else '['}{shown(lo)}, {shown(hi)}]"
    else:
        bounds = f"{'>' if open_low else '>='} {shown(lo)}" if lo is not None else f"<= {shown(hi)}"
    if hi is not None and value > hi:
        kind, words = "less_than_equal", f"less than or equal to {shown(hi)}"
    elif open_low:
        kind, words = "greater_than", f"greater than {shown(lo)}"
    else:
        kind, words = "greater_than_equal", f"greater than or equal to {shown(lo)}"
    return BadRequest(f"'{name}' must be {bounds}, got {value} ({kind}: Input should be {words})", param=name)


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, open_low: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a number", param=name)
    if not (lo < value if open_low else lo <= value) or value > hi:
        raise out_of_range(name, value, lo, hi, open_low=open_low)
    return float(value)


def _token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise BadRequest("'logit_bias' must be an object mapping token ids to biases", param="logit_bias")
    out, bad_keys, bad_biases = [], [], []   # every bad entry is named, not only the first
    for key, bias in value.items():
        token = key.strip() if isinstance(key, str) else ""
        if not token.isdigit() or not token.isascii():
            bad_keys.append(key)
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or abs(bias) > MAX_LOGIT_BIAS:
            bad_biases.append(key)
        else:
            out.append((int(token), float(bias)))
    problems = ([f"key{'s' if len(bad_keys) > 1 else ''} {_listed(bad_keys)} {'are' if len(bad_keys) > 1 else 'is'} "
                 f"not token ids"] if bad_keys else []) \
        + ([f"the bias{'es' if len(bad_biases) > 1 else ''} of {_listed(bad_biases)} must be numbers in [-100, 100]"]
           if bad_biases else [])
    if problems:
        raise BadRequest("logit_bias: " + "; ".join(problems), param="logit_bias")
    return tuple(out)


def _listed(values: list, most: int = 20) -> str:
    shown = ", ".join(repr(v) for v in values[:most])
    return shown + (f" and {len(values) - most} more" if len(values) > most else "")


def parse_options(body: dict) -> SamplingOptions:
    """The options of a request body (400 naming the option when one is malformed)."""
    min_tokens = body.get("min_tokens")
    if min_tokens is not None and not _token_id(min_tokens):
        raise BadRequest("'min_tokens' must be an integer >= 0", param="min_tokens")
    bad_words = body.get("bad_words")
    if bad_words is not None and (not isinstance(bad_words, list) or len(bad_words) > MAX_BAD_WORDS
                                  or not all(isinstance(w, str) and w.strip() for w in bad_words)):
        raise BadRequest(f"'bad_words' must be a list of at most {MAX_BAD_WORDS} non-empty strings", param="bad_words")
    allowed = body.get("allowed_token_ids")
    if allowed is not None and (not isinstance(allowed, list) or not allowed or not all(_token_id(t) for t in allowed)):
        raise BadRequest("'allowed_token_ids' must be a non-empty list of token ids", param="allowed_token_ids")
    return SamplingOptions(
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY, open_low=True),
        logit_bias=_logit_bias(body), min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        min_tokens=min_tokens or 0, bad_words=tuple(bad_words or ()),
        allowed_token_ids=None if allowed is None else tuple(dict.fromkeys(allowed)))


def check_vocab(ids: list[int], vocab_size: int, param: str) -> None:
    """400 naming ``param`` and every id of ``ids`` outside the vocabulary (vLLM's words, "out of
    vocabulary", which its clients match)."""
    outside = sorted({t for t in ids if t >= vocab_size})
    if outside:
        raise BadRequest(f"token id{'s' if len(outside) > 1 else ''} {_listed(outside)} "
                         f"{'are' if len(outside) > 1 else 'is'} out of vocabulary (the model's vocabulary has "
                         f"{vocab_size} tokens)", param=param)


def bad_words_token_ids(tokenizer, words: tuple[str, ...]) -> list[list[int]]:
    """vLLM's tokenization of ``bad_words`` (see the module docstring)."""
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"])
        spaced = list(tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"])
        if plain:
            out.append(plain)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


def wire_options(options: SamplingOptions, *, vocab_size: int, tokenizer, max_tokens: int) -> dict[str, Any]:
    """The :class:`~omnirelay.request_params.TextParams` fields of ``options`` for a model (400 for
    ids outside its vocabulary, or ``min_tokens`` above ``max_tokens``); neutral options are left
    out, and so is ``min_tokens``, which each submission sets itself (:func:`submission_min_tokens`)."""
    out: dict[str, Any] = {}
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                          ("min_p", 0.0)):
        if getattr(options, name) != neutral:
            out[name] = getattr(options, name)
    if options.logit_bias:
        check_vocab([t for t, _ in options.logit_bias], vocab_size, "logit_bias")
        out["logit_bias"] = tuple((t, float(b)) for t, b in options.logit_bias if b != 0) or None
    if options.allowed_token_ids is not None:
        check_vocab(list(options.allowed_token_ids), vocab_size, "allowed_token_ids")
        out["allowed_token_ids"] = tuple(options.allowed_token_ids)
    if options.min_tokens > max_tokens:
        raise BadRequest(f"min_tokens={options.min_tokens} is more than max_tokens={max_tokens}", param="min_tokens")
    if options.bad_words:
        out["bad_words_token_ids"] = tuple(map(tuple, bad_words_token_ids(tokenizer, options.bad_words)))
    return {k: v for k, v in out.items() if v is not None}


def submission_min_tokens(options: SamplingOptions, generated: int) -> int:
    """The ``min_tokens`` of a submission that starts after ``generated`` output tokens."""
    return max(options.min_tokens - generated, 0)
