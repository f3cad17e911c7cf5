"""The sparse MoE block of Qwen3-MoE for the compact model (:mod:`.llama`).

Math (transformers' ``Qwen3MoeSparseMoeBlock``/``Qwen3MoeTopKRouter``, checked token for token by
the tests): router logits ``x @ gate.T`` in the model dtype → softmax in float32 → ``torch.topk``
(so ties break exactly as transformers breaks them) → with ``norm_topk_prob`` the k weights are
renormalised to sum to 1 → cast back to the model dtype; each chosen expert is a SwiGLU MLP
(``down(silu(gate(x)) * up(x))``) and a token's output is the weighted sum of its experts' outputs,
added in ascending expert order.

Batched expert path (:func:`run_experts`): the (token, expert) pairs are sorted by expert, and each
expert that received tokens runs once, one ``[n, hidden] @ [hidden, 2 * inter]`` gate/up matmul
and one down matmul over all its rows: the loop is over active experts, never over tokens.

Which layers are sparse (:meth:`MoeConfig.is_sparse`): layer ``i`` unless it is in
``mlp_only_layers``, and only when ``(i + 1) % decoder_sparse_step == 0``; the others keep the
dense MLP of ``intermediate_size``.

Sharding (:class:`SparseMoE`): without expert parallelism a tensor rank holds every expert's slice
of the intermediate columns (gate/up rows, down columns) and the block's partial output is summed
with the stage's all-reduce, as the dense MLP does. With expert parallelism a rank holds whole
experts of its contiguous block and tokens travel to them by all-to-all
(:mod:`omnirelay.workers.llm.expert_parallel`). The router is replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
import torch.nn.functional as F

from omnirelay.workers.llm.expert_parallel import ExpertCollective, ExpertDispatch, expert_range, sorted_pairs


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int          # of one expert (moe_intermediate_size)
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_raw(cls, raw: dict) -> "MoeConfig | None":
        """From a Qwen3-MoE ``config.json`` (transformers writes ``num_local_experts`` beside, or
        instead of, the hub's ``num_experts``); None when the model has no experts."""
        experts = raw.get("num_experts", raw.get("num_local_experts")) or 0
        if not experts:
            return None
        return cls(num_experts=int(experts), top_k=int(raw["num_experts_per_tok"]),
                   intermediate_size=int(raw["moe_intermediate_size"]),
                   norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                   decoder_sparse_step=int(raw.get("decoder_sparse_step", 1) or 1),
                   mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()))

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` in the logits' dtype, expert ids ``[T, k]``) from router logits ``[T, E]``."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def run_experts(rows: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """Unweighted outputs of ``rows [N, hidden]``, row i through expert ``experts[i]`` (an index
    into ``gate_up [E, 2 * inter, hidden]`` / ``down [E, hidden, inter]``), in the rows' order."""
    out = torch.empty_like(rows)
    if rows.shape[0] == 0:
        return out
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=gate_up.shape[0]).tolist()
    start = 0
    for expert, n in enumerate(counts):
        if not n:
            continue
        index = order[start:start + n]
        gate, up = F.linear(rows.index_select(0, index), gate_up[expert]).chunk(2, dim=-1)
        out.index_copy_(0, index, F.linear(F.silu(gate) * up, down[expert]))
        start += n
    return out


class SparseMoE:
    """One layer's MoE block on one rank. ``comm``: the stage's collectives (None on one rank);
    ``expert_parallel``: whole experts per rank (see the module docstring)."""

    def __init__(self, config: MoeConfig, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *,
                 rank: int = 0, size: int = 1, expert_parallel: bool = False,
                 comm: ExpertCollective | None = None):
        self.config = config
        self.router = router
        self.gate_up = gate_up
        self.down = down
        self.comm = comm if size > 1 else None
        self.dispatch = ExpertDispatch(comm, rank, size, config.num_experts) if expert_parallel and size > 1 else None

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(F.linear(x, self.router), self.config.top_k, self.config.norm_topk_prob)

    def _compute(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return run_experts(rows, experts, self.gate_up, self.down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` (the post-attention norm's output, the same on every rank) → the
        block's whole output ``[T, hidden]`` on every rank."""
        if self.dispatch is not None:
            return self.dispatch(x, self._route, self._compute)
        token, expert, weight = sorted_pairs(*self._route(x))
        done = self._compute(x.index_select(0, token), expert)
        out = torch.zeros_like(x).index_add_(0, token, done * weight[:, None])
        if self.comm is not None:
            self.comm.all_reduce(out)   # tensor-parallel: each rank summed its intermediate slice
        return out


class WeightSource(Protocol):
    """What :func:`load_moe` reads from (the compact model's safetensors reader)."""

    def has(self, name: str) -> bool: ...

    def get(self, name: str, dim: int | None = None, rank: int = 0, parts: int = 1) -> torch.Tensor: ...


def load_moe(w: WeightSource, prefix: str, config: MoeConfig, *, rank: int, size: int, expert_parallel: bool,
             comm: ExpertCollective | None) -> SparseMoE:
    """Read a sparse block under ``prefix`` (``model.layers.<i>.mlp.``) from a ``_Weights``: the
    hub layout (``experts.<e>.{gate,up,down}_proj.weight``) or transformers 5's fused one
    (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``). ``rank`` / ``size``: the
    stage's tensor ranks; with ``expert_parallel`` the rank reads only its experts, else every
    expert's intermediate slice."""
    inter = config.intermediate_size
    if expert_parallel and size > 1:
        experts = expert_range(config.num_experts, size, rank)
        cols = slice(0, inter)
    else:
        if inter % size:
            raise ValueError(f"tensor parallel size {size} must divide the experts' intermediate size {inter}")
        experts = range(config.num_experts)
        part = inter // size
        cols = slice(rank * part, (rank + 1) * part)
    if w.has(prefix + "experts.gate_up_proj"):
        fused = w.get(prefix + "experts.gate_up_proj")[experts.start:experts.stop]
        gate_up = torch.cat((fused[:, :inter][:, cols], fused[:, inter:][:, cols]), dim=1).contiguous()
        down = w.get(prefix + "experts.down_proj")[experts.start:experts.stop, :, cols].contiguous()
    else:
        r, parts = (0, 1) if expert_parallel else (rank, size)   # whole experts, or every expert's slice
        gate_up = torch.stack([torch.cat((w.get(f"{prefix}experts.{e}.gate_proj.weight", 0, r, parts),
                                          w.get(f"{prefix}experts.{e}.up_proj.weight", 0, r, parts)))
                               for e in experts])
        down = torch.stack([w.get(f"{prefix}experts.{e}.down_proj.weight", 1, r, parts) for e in experts])
    return SparseMoE(config, w.get(prefix + "gate.weight"), gate_up, down, rank=rank, size=size,
                     expert_parallel=expert_parallel, comm=comm)
