"""What a request asks its stages for: one typed struct per request kind, carried on the bus.

The gateway validates an OpenAI request and builds one of these; :class:`~omnirelay.broker.protocol.Submit`
carries it as ``params`` and the broker copies it into every :class:`~omnirelay.broker.protocol.Task`
of the request unchanged (the broker reads only :func:`adapter_of`, for routing). The bus decoder
validates it like every other field of a message — msgspec's types, then each struct's
``__post_init__`` — so a worker never sees a malformed one::

    RequestParams = TextParams      (tag "text":   an LLM answer: prefill, decode; spoken when .speech is set)
                  | SpeechParams    (tag "speech": text read aloud, /v1/audio/speech: prefill, generate)
                  | ImageParams     (tag "image":  a diffusion pipeline's image, /v1/images/*)
                  | VideoParams     (tag "video":  a diffusion pipeline's video, /v1/videos)
                  | PoolingParams   (tag "pool":   a pooled vector, /v1/embeddings: prefill only)

A stage refuses a kind it does not serve with ``bad_request`` (workers/runtime/roles.py and the
generate roles). A struct's checks raise :class:`~omnirelay.errors.InvalidParam`: a 400 naming the
parameter when the gateway builds it, a validation error of the message when the bus decodes it.

Log-probabilities (:attr:`TextParams.logprobs` >= 0): the worker that samples a token also reports
its raw log-probability and the top ``logprobs`` alternatives (workers/llm/sampling.py).
Structured outputs (:attr:`TextParams.structured`): the sampling worker enforces a grammar
(workers/llm/structured_output.py). LoRA (:attr:`TextParams.lora`): the adapter the LLM stages
apply ("" = the base model), found on the worker's host by its ``--lora-modules`` or at ``lora_path``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, TypeVar

import msgspec

from omnirelay.errors import InvalidParam
from omnirelay.image_params import ImageParams
from omnirelay.pooling_params import PoolingParams
from omnirelay.speech_params import SpeechParams
from omnirelay.video_params import VideoParams

MAX_TOP_LOGPROBS = 20              # alternatives per token a request may ask for (OpenAI's and vLLM's limit)
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar")
MAX_STRUCTURED_SPEC_CHARS = 256 * 1024
MAX_CACHE_SALT_CHARS = 1024
MAX_LOGPROB_TOKEN_IDS = 128        # logprob_token_ids: ids whose logprobs each position reports
_SAMPLING_EPS = 1e-5


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token(value: Any) -> bool:
    return _is_int(value) and value >= 0


class StructuredOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The output must match a grammar. ``kind``: ``json_schema`` (``spec``: the schema as JSON
    text), ``json_object`` (any JSON object; ``spec`` empty), ``regex`` or ``grammar`` (xgrammar's
    EBNF, root rule ``root``). The gateway checks the spec compiles before it submits (400
    otherwise); the worker that samples compiles it again for its tokenizer. Hashable: the workers'
    compile cache is keyed by its kind and spec.

    ``after``: the token ids that end a thinking model's reasoning (``</think>`` as its tokenizer
    writes it); when given, the grammar applies only to the tokens after their first appearance in
    the output (vLLM's rule: structured outputs shape the answer, not the reasoning). Empty: from
    the first token."""

    kind: str
    spec: str = ""
    after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidParam(f"structured kind must be one of {', '.join(STRUCTURED_KINDS)}", param="response_format")
        if (self.kind == "json_object") != (not self.spec) or len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise InvalidParam(f"structured {self.kind}: spec must be "
                               f"{'empty' if self.kind == 'json_object' else 'a non-empty string'}"
                               f" of at most {MAX_STRUCTURED_SPEC_CHARS} characters", param="response_format")
        if len(self.after) > 64 or any(t < 0 for t in self.after):
            raise InvalidParam("structured after: at most 64 token ids, none negative", param="response_format")


class TextParams(msgspec.Struct, tag="text", frozen=True, forbid_unknown_fields=True, omit_defaults=True,
                 dict=True):
    """How the LLM stages sample an answer (vLLM's sampling parameters, each range checked here).

    ``max_tokens`` and ``min_tokens`` count from this submission's first token (a resumed stream
    sends what is left). ``top_k`` 0 or -1: off. ``logprobs`` -1: none; 0: the chosen token's; k:
    also the top k. ``logit_bias``: (token id, bias) pairs; ``bad_words_token_ids``: token sequences
    never completed; ``allowed_token_ids``: empty means every token. ``speech``: the answer is also
    spoken (prefill and decode export the thinker's hidden states; the generate stage speaks).
    ``logprob_token_ids`` (with ``logprobs`` >= 0): each position reports these ids' logprobs instead
    of its top k (vLLM's). ``prompt_logprobs`` -1: none; k >= 0: prefill also scores the prompt's own tokens, with the top
    k of each position (workers/llm/prompt_logprobs.py). ``cache_salt``: enters the names of the
    prompt's prefix-cache blocks (omnirelay/block_hash.py), so equal prompts of other salts share none."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = -1
    # Logits processing (workers/llm/logits_processors.py, which documents the semantics and order).
    presence_penalty: float = 0.0       # [-2, 2], over output tokens
    frequency_penalty: float = 0.0      # [-2, 2], over output tokens
    repetition_penalty: float = 1.0     # (0, 100], over prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100])
    min_p: float = 0.0                  # [0, 1]
    min_tokens: int = 0
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    structured: StructuredOutput | None = None
    # The LoRA adapter ("": the base model) and its directory on the worker's host ("": the
    # worker's own --lora-modules).
    lora: str = ""
    lora_path: str = ""
    speech: SpeechParams | None = None
    prompt_logprobs: int = -1
    cache_salt: str = ""
    logprob_token_ids: tuple[int, ...] = ()   # with logprobs: these ids' logprobs instead of the top k

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidParam("max_tokens must be an integer >= 1", param="max_tokens")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidParam("temperature must be a number >= 0", param="temperature")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidParam("top_p must be in (0, 1]", param="top_p")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidParam("top_k must be -1, 0 or positive", param="top_k")
        if not _is_int(self.logprobs) or not -1 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParam(f"logprobs must be an integer from -1 to {MAX_TOP_LOGPROBS}", param="logprobs")
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                             ("repetition_penalty", 0.0, 100.0), ("min_p", 0.0, 1.0)):
            value = getattr(self, name)
            if not _is_number(value) or not lo <= value <= hi or (name == "repetition_penalty" and value == 0):
                raise InvalidParam(f"{name} must be a number in [{lo:g}, {hi:g}]"
                                   + (" and > 0" if name == "repetition_penalty" else ""), param=name)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidParam("min_tokens must be an integer >= 0", param="min_tokens")
        if not all(isinstance(pair, tuple) and len(pair) == 2 and _is_token(pair[0]) and _is_number(pair[1])
                   and -100 <= pair[1] <= 100 for pair in self.logit_bias):
            raise InvalidParam("logit_bias must be (token id, bias in [-100, 100]) pairs", param="logit_bias")
        if not all(isinstance(word, tuple) and word and all(_is_token(t) for t in word)
                   for word in self.bad_words_token_ids):
            raise InvalidParam("bad_words_token_ids must be non-empty sequences of token ids", param="bad_words")
        for name in ("allowed_token_ids", "stop_token_ids"):
            if not all(_is_token(t) for t in getattr(self, name)):
                raise InvalidParam(f"{name} must be token ids", param=name)
        if self.lora_path and not self.lora:
            raise InvalidParam("lora_path needs a lora name", param="model")
        if not _is_int(self.prompt_logprobs) or not -1 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParam(f"prompt_logprobs must be an integer from -1 to {MAX_TOP_LOGPROBS}",
                               param="prompt_logprobs")
        if not all(_is_token(t) for t in self.logprob_token_ids) or len(self.logprob_token_ids) > MAX_LOGPROB_TOKEN_IDS \
                or (self.logprob_token_ids and self.logprobs < 0):
            raise InvalidParam(f"logprob_token_ids must be at most {MAX_LOGPROB_TOKEN_IDS} token ids, with logprobs",
                               param="logprob_token_ids")
        if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidParam(f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters", param="cache_salt")

    # Views the sampler reads every step, computed once per request.

    @functools.cached_property
    def max_token_id(self) -> int:
        """The largest token id the logits processors index the logits with (-1: none). Not
        ``stop_token_ids``: an id outside the vocabulary there just never matches (and the
        ``min_tokens`` step skips it)."""
        return max((*self.allowed_token_ids, *(t for t, _ in self.logit_bias),
                    *(t for word in self.bad_words_token_ids for t in word), *self.logprob_token_ids), default=-1)

    @functools.cached_property
    def allowed_ids(self) -> "torch.Tensor":
        """``allowed_token_ids`` as a tensor (the list may be long). Only workers read the tensor
        views, so torch is imported here, not by the gateway that builds the struct."""
        import torch
        return torch.tensor(self.allowed_token_ids, dtype=torch.long)

    @functools.cached_property
    def logit_bias_tensors(self) -> "tuple[torch.Tensor, torch.Tensor]":
        """``logit_bias`` as (token ids, biases) tensors."""
        import torch
        return (torch.tensor([t for t, _ in self.logit_bias], dtype=torch.long),
                torch.tensor([b for _, b in self.logit_bias], dtype=torch.float32))

    def check_vocab(self, vocab_size: int) -> None:
        """``InvalidParam`` when :attr:`max_token_id` is outside a vocabulary of ``vocab_size``."""
        if self.max_token_id >= vocab_size:
            raise InvalidParam(f"token id {self.max_token_id} is outside the vocabulary ({vocab_size})")

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


RequestParams = TextParams | SpeechParams | ImageParams | VideoParams | PoolingParams
_Kind = TypeVar("_Kind", TextParams, SpeechParams, ImageParams, VideoParams, PoolingParams)

# What the prefill stage of a /v1/audio/speech request samples: one greedy token nobody reads
# (the text is teacher-forced; prefill exists to compute the talker's hidden states).
SPEECH_PREFILL = TextParams(max_tokens=1, temperature=0.0)
# What the prefill stage of a pooling request samples: likewise one greedy token nobody reads (the
# forward that pools also yields logits; sampling them keeps one path through the engine).
POOLING_PREFILL = SPEECH_PREFILL


def speech_of(params: RequestParams) -> SpeechParams | None:
    """The speech a request asks for: a spoken answer's, a read-aloud text's, or None."""
    if isinstance(params, SpeechParams):
        return params
    return params.speech if isinstance(params, TextParams) else None


def text_params_of(params: RequestParams) -> TextParams:
    """What an LLM stage samples for ``params``; ``InvalidParam`` for a kind no LLM stage serves."""
    if isinstance(params, TextParams):
        return params
    if isinstance(params, SpeechParams):
        return SPEECH_PREFILL
    if isinstance(params, PoolingParams):
        return msgspec.structs.replace(POOLING_PREFILL, cache_salt=params.cache_salt) if params.cache_salt \
            else POOLING_PREFILL
    raise InvalidParam(f"an LLM stage cannot serve a {type(params).__name__} request")


def expect_params(params: RequestParams, kind: type[_Kind]) -> _Kind:
    """``params`` when it is of ``kind``; ``InvalidParam`` otherwise (a stage sent a request it
    does not serve: the broker routes by model and stage, so only a misconfigured pipeline does)."""
    if not isinstance(params, kind):
        raise InvalidParam(f"this stage serves {kind.__name__} requests, not {type(params).__name__}")
    return params


def adapter_of(params: RequestParams) -> str:
    """The LoRA adapter a request names ("" for the base model or a non-text request)."""
    return params.lora if isinstance(params, TextParams) else ""


def salt_of(params: RequestParams) -> str:
    """The ``cache_salt`` a request names ("" for none or a request of another kind)."""
    return params.cache_salt if isinstance(params, (TextParams, PoolingParams)) else ""

