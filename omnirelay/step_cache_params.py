"""Diffusion step caching as asked for: vLLM-Omni's ``--cache-backend`` and ``--cache-config`` flags,
and the same two fields per request (``extra_body={"cache_backend": …, "cache_config": {…}}``).

Backends (what :mod:`omnirelay.workers.generate.step_cache` does with them):

==============  ==========================================================================================
``none``        the plain loop: every step runs the transformer (the default)
``tea_cache``   TeaCache: a step's transformer is skipped while the relative L1 change of its
                timestep-modulated input, accumulated since the last computed step, stays under
                ``rel_l1_thresh`` (default 0.2); a skipped step reuses the residual (output − input)
                of the last computed one. The first and last steps always compute.
``static``      a fixed step mask: only ``steps`` (indices from 0) compute, or with ``interval`` k every
                k-th step; step 0 and the last step always compute. The deterministic form: the same
                request skips the same steps whatever its content.
==============  ==========================================================================================

Keys of ``cache_config`` other than these are refused by name (a 400 on a request, an error at
start-up), as is a backend we do not serve (``cache_dit``: 422 on a request). Plain Python, no
torch: the gateway and the worker's config read it.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

from omnirelay.errors import InvalidParam, Unprocessable

BACKENDS = ("none", "tea_cache", "static")
UNSERVED_BACKENDS = ("cache_dit", "mag_cache")      # vLLM-Omni's others: "not served", not "unknown"
KEYS = {"tea_cache": ("rel_l1_thresh",), "static": ("steps", "interval"), "none": ()}
DEFAULT_REL_L1_THRESH = 0.2
MAX_STEP_INDEX = 1000


class StepCacheSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """backend: one of :data:`BACKENDS`; rel_l1_thresh: ``tea_cache``'s threshold; steps / interval:
    ``static``'s mask (give one). Validated on construction (and when the bus decodes it)."""

    backend: str = "none"
    rel_l1_thresh: float = DEFAULT_REL_L1_THRESH
    steps: tuple[int, ...] = ()
    interval: int = 0

    def __post_init__(self) -> None:
        if self.backend in UNSERVED_BACKENDS:
            raise Unprocessable(f"cache backend {self.backend!r} is not served (served: {', '.join(BACKENDS)})",
                                param="cache_backend")
        if self.backend not in BACKENDS:
            raise InvalidParam(f"'cache_backend' must be one of {', '.join(BACKENDS)}, got {self.backend!r}",
                               param="cache_backend")
        thresh = self.rel_l1_thresh
        if isinstance(thresh, bool) or not isinstance(thresh, (int, float)) or not math.isfinite(thresh) \
                or not 0 <= thresh <= 10:
            raise InvalidParam(f"'cache_config.rel_l1_thresh' must be a number in [0, 10], got {thresh!r}",
                               param="cache_config")
        msgspec.structs.force_setattr(self, "rel_l1_thresh", float(thresh))
        if any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_STEP_INDEX for s in self.steps):
            raise InvalidParam(f"'cache_config.steps' must be step indices from 0 to {MAX_STEP_INDEX}",
                               param="cache_config")
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or not 0 <= self.interval <= 100:
            raise InvalidParam("'cache_config.interval' must be an integer from 0 to 100", param="cache_config")
        if self.backend == "static" and bool(self.steps) == bool(self.interval):
            raise InvalidParam("the static cache takes 'steps' (a list of step indices) or 'interval', one of them",
                               param="cache_config")

    @property
    def enabled(self) -> bool:
        return self.backend != "none"

    def computes(self, step: int, steps: int) -> bool:
        """``static``: whether step ``step`` of ``steps`` runs the transformer."""
        if step == 0 or step == steps - 1:
            return True
        return step in self.steps if self.steps else step % self.interval == 0


def spec_from(backend: Any, config: Any) -> StepCacheSpec:
    """A spec from the two fields as given (``config``: a JSON object, or its text as a form or a flag
    sends it); raises :class:`InvalidParam` / :class:`Unprocessable` naming the field."""
    if not isinstance(backend, str) or not backend:
        raise InvalidParam("'cache_backend' must be a non-empty string", param="cache_backend")
    if isinstance(config, str):
        try:
            config = json.loads(config) if config.strip() else {}
        except ValueError:
            raise InvalidParam(f"'cache_config' must be a JSON object, got {config!r}", param="cache_config") from None
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise InvalidParam("'cache_config' must be a JSON object", param="cache_config")
    allowed = KEYS.get(backend, ())
    unknown = sorted(set(config) - set(allowed))
    if unknown and backend in KEYS:
        raise InvalidParam(f"'cache_config' key(s) {', '.join(unknown)} do not apply to cache backend {backend!r} "
                           f"(it takes: {', '.join(allowed) or 'nothing'})", param="cache_config")
    steps = config.get("steps", ())
    if not isinstance(steps, (list, tuple)):
        raise InvalidParam("'cache_config.steps' must be a list of step indices", param="cache_config")
    fields = {k: v for k, v in config.items() if k != "steps"}
    return StepCacheSpec(backend=backend, steps=tuple(steps), **fields)


def parse_flag(backend: str, config: str) -> StepCacheSpec:
    """The worker's ``--cache-backend`` / ``--cache-config``; a ValueError names what is wrong."""
    try:
        return spec_from(backend or "none", config)
    except (InvalidParam, Unprocessable) as exc:
        raise ValueError(f"--cache-backend/--cache-config: {exc}") from None
