"""Step caching of a diffusion transformer: which denoising steps run the transformer, and what a
skipped step uses instead.

Life of one denoising step of a batch under a :class:`StepCache` (the runner calls, in order)::

    probe: the step's timestep-modulated input (the family's, e.g. Wan's first block's
           norm1(x)·(1 + scale(t)) + shift(t)), only for ``tea_cache``
    plan(step, probe) ──▶ for each CFG branch (0: conditional, 1: unconditional) compute or skip
    computed branches: one batched transformer forward ──▶ record(branch, input, output)
                       (the residual output − input is kept, per branch, per row)
    skipped branches:  reuse(branch, input) = input + that branch's last residual

Ownership and lifetime: a cache belongs to one running batch (``VideoJob.step_cache``), made fresh
when the batch is admitted and dropped with it, so a residual never outlives its request; each CFG
branch has its own :class:`BranchCache` (its own residual and accumulated distance), so one
branch's residual never stands in for the other's. Rows that leave the batch (a cancel) are cut
out of the residuals (:meth:`StepCache.keep_rows`). Counters ``computed`` / ``skipped`` (branch-steps)
feed the worker's stats and ``/metrics``.

TeaCache here accumulates the raw relative L1 distance (mean |Δ| / mean |previous|) of the
modulated input; the original rescales it with a per-model polynomial fitted on real checkpoints,
which a random-weight model has no use for — ``rel_l1_thresh`` is therefore on the raw scale.
"""

from __future__ import annotations

import dataclasses

import torch

from omnirelay.step_cache_params import StepCacheSpec

BRANCHES = ("cond", "uncond")


@dataclasses.dataclass
class BranchCache:
    """One CFG branch's state: the last computed residual (rows × latent shape), the probe of the
    previous step and the distance accumulated since the last computed step."""

    residual: torch.Tensor | None = None
    previous_probe: torch.Tensor | None = None
    accumulated: float = 0.0


class StepCache:
    """The cache of one running batch (see the module docstring). ``spec``: the policy (``none``:
    every step computes, nothing is kept); ``steps``: the batch's number of denoising steps."""

    def __init__(self, spec: StepCacheSpec, steps: int):
        self.spec = spec
        self.steps = steps
        self.branches = [BranchCache() for _ in BRANCHES]
        self.computed = 0
        self.skipped = 0
        self.model: str = ""      # the transformer the residuals came from (Wan 2.2 switches experts)

    @property
    def enabled(self) -> bool:
        return self.spec.enabled

    @property
    def needs_probe(self) -> bool:
        return self.spec.backend == "tea_cache"

    def use_model(self, name: str) -> None:
        """Say which transformer runs this step: a residual of another one (the other Wan 2.2 expert)
        is dropped, so the first step of each expert computes."""
        if name != self.model:
            self.model = name
            self.branches = [BranchCache() for _ in BRANCHES]

    def plan(self, step: int, branches: int, probe: torch.Tensor | None = None) -> list[bool]:
        """Whether each of the first ``branches`` CFG branches runs the transformer at ``step``
        (``probe``: the modulated input, for ``tea_cache``). Counts the outcome."""
        plan = [self._computes(self.branches[b], step, probe) for b in range(branches)]
        self.computed += sum(plan)
        self.skipped += len(plan) - sum(plan)
        return plan

    def _computes(self, branch: BranchCache, step: int, probe: torch.Tensor | None) -> bool:
        backend = self.spec.backend
        if backend == "none":
            return True
        if branch.residual is None:           # nothing to reuse yet (step 0, or a fresh branch)
            computes = True
        elif backend == "static":
            computes = self.spec.computes(step, self.steps)
        else:
            computes = step == self.steps - 1
            if branch.previous_probe is not None:
                previous = branch.previous_probe
                branch.accumulated += float((probe - previous).abs().mean() / previous.abs().mean().clamp_min(1e-12))
            computes = computes or branch.accumulated >= self.spec.rel_l1_thresh
        if backend == "tea_cache":
            branch.previous_probe = probe
            if computes:
                branch.accumulated = 0.0
        return computes

    def record(self, branch: int, inputs: torch.Tensor, output: torch.Tensor) -> None:
        """Keep a computed branch's residual (nothing under ``none``)."""
        if self.spec.enabled:
            self.branches[branch].residual = output - inputs

    def reuse(self, branch: int, inputs: torch.Tensor) -> torch.Tensor:
        """A skipped branch's output: its input plus its last computed residual."""
        residual = self.branches[branch].residual
        if residual is None:
            raise AssertionError(f"branch {BRANCHES[branch]} skipped a step before computing one")
        return inputs + residual

    def keep_rows(self, index: torch.Tensor) -> None:
        """Cut the rows of requests that left the batch out of every branch's tensors."""
        for branch in self.branches:
            for name in ("residual", "previous_probe"):
                tensor = getattr(branch, name)
                if tensor is not None:
                    setattr(branch, name, tensor.index_select(0, index.to(tensor.device)))
