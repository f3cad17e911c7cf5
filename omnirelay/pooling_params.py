"""What a pooling request asks of the prefill stage, and how a model's pooling is configured.

An embedding (``/v1/embeddings``) is a prefill-only request: the prefill worker runs the prompt
through the model as for chat, then, instead of sampling a first token and handing its KV to decode,
pools the final-norm hidden states of the prompt into one vector and pushes it straight to the
gateway (:class:`~omnirelay.broker.protocol.PooledResult`). Decode is never involved: the request's
stage list is ``["prefill"]``.

Two contracts live here, shared by the gateway (which builds them) and the workers (which obey):

* :class:`PoolerConfig` -- how a served model pools, resolved once from its directory by
  :func:`resolve_pooler_config`: sentence-transformers' ``modules.json`` with its ``Pooling`` module's
  ``config.json`` (CLS, mean or last token) and a ``Normalize`` module; without them the family default
  of decoder models, vLLM's: the last token, L2-normalised; an explicit ``--pooler-config`` JSON (vLLM's
  flag: ``pooling_type``, ``normalize``) overrides both. ``config.json``'s ``matryoshka_dimensions``
  (the truncations the model was trained for) or ``is_matryoshka`` (any) say whether a request may ask
  for fewer ``dimensions``, as vLLM reads them.
* :class:`PoolingParams` -- one request's pooling (or, for a decoder-only reranker, the softmax of
  its yes/no tokens' logits at the last token: ``label_token_ids``), tag ``pool`` in the bus's
  :data:`~omnirelay.request_params.RequestParams` union: the pooling type and normalisation from the
  model's config (or the request's ``normalize``), and the Matryoshka truncation (``dimensions``),
  applied before the normalisation so a truncated vector is unit length again.

The pooled vector travels as little-endian float32 bytes, the layout ``encoding_format: base64``
answers with, so the gateway passes them through without a conversion.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import msgspec

from omnirelay.errors import InvalidParam

POOLING_TYPES = ("last", "mean", "cls")
# vLLM's --pooler-config keys this server serves; any other key is refused at start-up, naming it.
_OVERRIDE_KEYS = ("pooling_type", "normalize")
MAX_CACHE_SALT_CHARS = 1024


class PoolingParams(msgspec.Struct, tag="pool", frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """How prefill pools one prompt. ``pooling``: which hidden states make the vector (``last``:
    the last prompt token's; ``mean``: the average over every prompt token; ``cls``: the first
    token's), all taken after the model's final norm. ``dimensions`` > 0: keep the first
    ``dimensions`` values (Matryoshka), before ``normalize`` (L2). ``cache_salt``: as
    :attr:`~omnirelay.request_params.TextParams.cache_salt`, for the prefix cache a last-token
    pooling may reuse."""

    pooling: str = "last"
    normalize: bool = True
    dimensions: int = 0
    cache_salt: str = ""
    # A decoder-only reranker (Qwen3-Reranker's card): the result is the softmax over these tokens'
    # logits at the last prompt token ((no, yes): the last value is the relevance), not a hidden state.
    label_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise InvalidParam(f"pooling must be one of {', '.join(POOLING_TYPES)}", param="pooling_type")
        if not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool) or self.dimensions < 0:
            raise InvalidParam("dimensions must be an integer >= 1", param="dimensions")
        if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidParam(f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters", param="cache_salt")
        if self.label_token_ids and (len(self.label_token_ids) > 16 or self.pooling != "last" or self.dimensions
                                     or any(not isinstance(t, int) or t < 0 for t in self.label_token_ids)):
            raise InvalidParam("label_token_ids: at most 16 token ids, scored at the last token, no dimensions",
                               param="model")

    @property
    def needs_every_token(self) -> bool:
        """Whether every prompt token's state is pooled (mean, CLS): then no cached prefix is skipped,
        since a block taken from the prefix cache is not run and leaves no hidden state."""
        return self.pooling != "last"


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How a served model pools (see the module docstring). ``hidden_size``: the vector's full
    length. ``matryoshka``: None when the model declares no Matryoshka training (``dimensions`` is
    then refused); () when any truncation is allowed (``is_matryoshka``); else the allowed sizes.
    ``source``: where the pooling came from, for ``/v1/models`` and the log."""

    pooling_type: str
    normalize: bool
    hidden_size: int
    matryoshka: tuple[int, ...] | None = None
    source: str = "default"

    def check_dimensions(self, dimensions: int) -> None:
        """``InvalidParam`` naming ``dimensions`` unless the model can be truncated to it."""
        if self.matryoshka is None:
            raise InvalidParam("this model does not support 'dimensions' (it declares no Matryoshka "
                               "representation: config.json has neither matryoshka_dimensions nor is_matryoshka)",
                               param="dimensions")
        if not 1 <= dimensions <= self.hidden_size or (self.matryoshka and dimensions not in self.matryoshka):
            allowed = ", ".join(map(str, self.matryoshka)) if self.matryoshka else f"1 to {self.hidden_size}"
            raise InvalidParam(f"dimensions {dimensions} is not supported by this model (allowed: {allowed})",
                               param="dimensions")

    def params(self, *, normalize: bool | None = None, dimensions: int | None = None,
               cache_salt: str = "") -> PoolingParams:
        """One request's :class:`PoolingParams`: this config, with the request's ``normalize`` (vLLM's
        extension; None: the model's) and ``dimensions`` (checked: :meth:`check_dimensions`)."""
        if dimensions is not None:
            self.check_dimensions(dimensions)
        return PoolingParams(pooling=self.pooling_type, normalize=self.normalize if normalize is None else normalize,
                             dimensions=0 if dimensions is None or dimensions == self.hidden_size else dimensions,
                             cache_salt=cache_salt)


def reranker_label_tokens(path: str | Path) -> tuple[str, ...]:
    """The tokens whose last-position logits score a decoder-only reranker (Qwen3-Reranker: ``("no",
    "yes")``), from ``config.json``'s ``classifier_from_token`` with ``is_original_qwen3_reranker``
    (what vLLM's ``--hf-overrides`` give the real checkpoint); () for any other model."""
    raw = json.loads((Path(path) / "config.json").read_text())
    tokens = raw.get("classifier_from_token")
    if not raw.get("is_original_qwen3_reranker") or not tokens:
        return ()
    if not isinstance(tokens, list) or len(tokens) != 2 or not all(isinstance(t, str) and t for t in tokens):
        raise ValueError(f"{path}/config.json: classifier_from_token must name two tokens (no, yes)")
    return tuple(tokens)


def resolve_pooler_config(path: str | Path, override: str = "") -> PoolerConfig:
    """The pooling of the model at ``path``: ``override`` (``--pooler-config``, a JSON object), else
    sentence-transformers' modules, else vLLM's decoder default (last token, normalised).
    ``ValueError`` (naming the file or key) for a configuration this server cannot follow."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    text = raw.get("text_config") or raw
    hidden = int(text["hidden_size"])
    pooling, normalize, source = "last", True, "default"
    modules = _sentence_transformers_modules(path)
    if modules is not None:
        pooling, normalize = modules
        source = "modules.json"
    if override:
        pooling, normalize = _override(override, pooling, normalize)
        source = "--pooler-config"
    return PoolerConfig(pooling, normalize, hidden, _matryoshka(raw, hidden), source)


def _sentence_transformers_modules(path: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) from ``modules.json`` and its ``Pooling`` module's config; None
    without ``modules.json``."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file}: expected a list of modules")
    pooling, normalize = "last", False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling"):
            pooling = _pooling_mode(path / str(module.get("path", "")) / "config.json")
        elif not kind.endswith(".Transformer"):
            raise ValueError(f"{modules_file}: module {kind!r} is not served (Transformer, Pooling and "
                             "Normalize are)")
    return pooling, normalize


def _pooling_mode(config_file: Path) -> str:
    config = json.loads(config_file.read_text())
    modes = {"cls": config.get("pooling_mode_cls_token"), "mean": config.get("pooling_mode_mean_tokens"),
             "last": config.get("pooling_mode_lasttoken")}
    chosen = [name for name, on in modes.items() if on]
    others = [k for k in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                          "pooling_mode_weightedmean_tokens") if config.get(k)]
    if others or len(chosen) != 1:
        raise ValueError(f"{config_file}: exactly one of pooling_mode_cls_token, pooling_mode_mean_tokens and "
                         f"pooling_mode_lasttoken must be set (served: CLS, mean, last token)")
    return chosen[0]


def _override(text: str, pooling: str, normalize: bool) -> tuple[str, bool]:
    try:
        given: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--pooler-config: not JSON: {exc}") from None
    if not isinstance(given, dict):
        raise ValueError("--pooler-config: expected a JSON object")
    unknown = sorted(set(given) - set(_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"--pooler-config: {unknown[0]!r} is not served (served: {', '.join(_OVERRIDE_KEYS)})")
    if "pooling_type" in given:
        value = given["pooling_type"]
        if not isinstance(value, str) or value.lower() not in POOLING_TYPES:
            raise ValueError(f"--pooler-config: pooling_type must be one of LAST, MEAN, CLS, got {value!r}")
        pooling = value.lower()
    if "normalize" in given:
        if not isinstance(given["normalize"], bool):
            raise ValueError("--pooler-config: normalize must be true or false")
        normalize = given["normalize"]
    return pooling, normalize


def _matryoshka(raw: dict, hidden: int) -> tuple[int, ...] | None:
    dims = raw.get("matryoshka_dimensions")
    if dims:
        if not isinstance(dims, list) or not all(isinstance(d, int) and 1 <= d <= hidden for d in dims):
            raise ValueError(f"config.json: matryoshka_dimensions must be sizes from 1 to {hidden}")
        return tuple(sorted(dims))
    return () if raw.get("is_matryoshka") else None
