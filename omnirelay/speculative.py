"""``--speculative-config``: speculative decoding in the decode role, configured as vLLM's flag of the
same name (a JSON object), also a decode stage's ``engine_args.speculative_config`` in a pipeline file.

Served: ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m,
"disable_by_batch_size": b}``. Each decode step drafts up to ``k`` tokens per sequence by prompt lookup
(the longest suffix of the sequence's tokens, ``m`` to ``n`` tokens long, found earlier in its prompt or
output: the tokens that followed it there) and verifies them in the same batched forward of the target
(``workers/llm/spec_decode.py``). ``prompt_lookup_min``/``max`` default as vLLM's: both 5, or one given
sets the other. ``disable_by_batch_size``: a step running more sequences than this drafts nothing (vLLM's
key; 0: never disabled).

Refused by name at start-up, never ignored: an unknown key, an unknown method, and vLLM's methods and keys
we do not serve (a draft or EAGLE/MTP model, suffix decoding, token trees: :data:`UNSERVED_METHODS`,
:data:`UNSERVED_KEYS`). Plain Python: the gateway, the launcher and the worker's config read it cheaply.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

METHODS = ("ngram",)
# vLLM's other methods: known, so a user gets "not served" rather than "unknown".
UNSERVED_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp",
                    "ernie_mtp", "qwen3_next_mtp", "longcat_flash_mtp", "glm4_moe_mtp", "suffix")
# vLLM's keys for what we do not serve (draft models and their parallelism, suffix decoding, trees).
UNSERVED_KEYS = ("model", "draft_tensor_parallel_size", "quantization", "max_model_len", "revision",
                 "code_revision", "disable_padded_drafter_batch", "speculative_token_tree", "enforce_eager",
                 "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                 "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob", "parallel_drafting")
SERVED_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
               "disable_by_batch_size")
DEFAULT_PROMPT_LOOKUP = 5   # vLLM's, when neither bound is given


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding of one decode worker (see the module docstring); validated on construction."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(_method_error(self.method))
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                raise ValueError(f"speculative_config.{key}: must be an integer >= 1, got {value!r}")
        if not _is_int(self.disable_by_batch_size) or self.disable_by_batch_size < 0:
            raise ValueError(f"speculative_config.disable_by_batch_size: must be an integer >= 0, "
                             f"got {self.disable_by_batch_size!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min {self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max {self.prompt_lookup_max}")

    def to_json(self) -> str:
        """The flag's value that gives this config back (a launcher hands it on to its workers)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _method_error(method: Any) -> str:
    if method in UNSERVED_METHODS:
        return (f"speculative_config.method {method!r} is not served by omnirelay "
                f"(served: {', '.join(METHODS)})")
    return f"speculative_config.method: unknown method {method!r} (served: {', '.join(METHODS)})"


def from_mapping(raw: Any) -> SpeculativeConfig:
    """The config from a decoded JSON object or a YAML mapping; ``ValueError`` naming the bad key or value."""
    if not isinstance(raw, dict):
        raise ValueError(f"speculative_config: expected a JSON object, got {raw!r}")
    for key in raw:
        if key in UNSERVED_KEYS:
            raise ValueError(f"speculative_config.{key}: not served by omnirelay (served keys: "
                             f"{', '.join(SERVED_KEYS)})")
        if key not in SERVED_KEYS:
            raise ValueError(f"speculative_config: unknown key {key!r} (served keys: {', '.join(SERVED_KEYS)})")
    if "method" not in raw:
        raise ValueError("speculative_config.method: required (served: " + ", ".join(METHODS) + ")")
    if raw["method"] not in METHODS:
        raise ValueError(_method_error(raw["method"]))
    if "num_speculative_tokens" not in raw:
        raise ValueError("speculative_config.num_speculative_tokens: required")
    values = dict(raw)
    low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
    # vLLM's defaults: neither bound given, both 5; one given, the other equals it.
    values["prompt_lookup_min"] = low if low is not None else (high if high is not None else DEFAULT_PROMPT_LOOKUP)
    values["prompt_lookup_max"] = high if high is not None else values["prompt_lookup_min"]
    return SpeculativeConfig(**values)


def parse(text: str) -> SpeculativeConfig | None:
    """``--speculative-config``'s value: a JSON object (``""``/``null``: off); ``ValueError`` naming the flag."""
    text = text.strip()
    if text in ("", "null"):
        return None
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--speculative-config: not JSON: {exc}") from None
    try:
        return from_mapping(raw)
    except ValueError as exc:
        raise ValueError(f"--speculative-config: {exc}") from None
