"""Expert parallelism inside one worker's group: which rank owns which experts, and the all-to-all
that carries tokens to their experts and the results back.

Placement (:func:`expert_range`), the one rule: with ``E`` experts over ``n`` ranks, rank ``r`` owns
the contiguous block ``[r * E / n, (r + 1) * E / n)``. ``E`` must divide by ``n``; a model whose
experts do not is refused at start-up (:class:`ExpertPlacementError`, a ``ValueError``), before
any weight is read. The expert-parallel group is the tensor-parallel group of the stage (vLLM's
``--enable-expert-parallel`` with data parallel size 1): attention stays tensor-parallel, the
sparse MoE blocks switch from "every rank holds a slice of every expert" to "every rank holds
whole experts of its block".

Life of one MoE block's tokens under expert parallelism (:meth:`ExpertDispatch.__call__`; every
rank enters with the same hidden states ``x [T, hidden]``, the output of the TP all-reduce):

    1. split:    rank r takes its contiguous chunk of the T tokens (:func:`token_chunks`) and routes
                 them (router logits → softmax → top-k, the caller's ``route``)
    2. dispatch: its (token, expert) pairs, sorted by expert, go to the experts' owners: one
                 all-to-all of the per-rank counts, one of the hidden rows, one of the expert ids
    3. compute:  each owner runs its experts on what it received, one matmul per active expert
    4. combine:  the results travel back by the reverse all-to-all; each rank weights them and sums
                 them into its chunk (expert order, as transformers sums), then one all-reduce of
                 the chunks (zeros elsewhere) gives every rank the whole block output again

Collectives run over gloo on the CPU and NCCL on CUDA (the tensors' device picks the backend). A
peer that dies mid-exchange makes the collective raise (gloo: the closed connection; NCCL: the
group's timeout); :class:`~omnirelay.workers.llm.parallel.GroupRunner` turns that into
:class:`~omnirelay.workers.runtime.rank_processes.ParallelGroupLost`.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch


class ExpertPlacementError(ValueError):
    """The experts cannot be placed on the group (raised at start-up)."""


class ExpertCollective(Protocol):
    """The collectives an expert-parallel MoE block needs, over the stage's ranks."""

    def all_reduce(self, tensor: torch.Tensor) -> None: ...

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int] | None,
                   input_splits: list[int] | None) -> None: ...


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The experts rank ``ep_rank`` of ``ep_size`` owns: one contiguous block of ``E / ep_size``."""
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ExpertPlacementError(f"expert parallel rank {ep_rank} of {ep_size} is not a rank of the group")
    if num_experts % ep_size:
        raise ExpertPlacementError(
            f"expert parallelism: the model's {num_experts} experts do not divide over the {ep_size} ranks of "
            f"the group (--tensor-parallel-size {ep_size} with --enable-expert-parallel); each rank owns a "
            f"contiguous block of experts, so the group size must divide {num_experts}")
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def check_expert_parallel(moe, ep_size: int) -> None:
    """Start-up check of ``--enable-expert-parallel`` for a model whose MoE config is ``moe``
    (a :class:`~omnirelay.workers.llm.models.moe.MoeConfig`, None for a dense model)."""
    if moe is None:
        raise ExpertPlacementError("--enable-expert-parallel: the model has no experts (not a mixture-of-experts model)")
    expert_range(moe.num_experts, ep_size, 0)


def token_chunks(num_tokens: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous chunks of ``num_tokens``, as even as possible, earlier larger."""
    base, extra = divmod(num_tokens, parts)
    return [base + (i < extra) for i in range(parts)]


# compute(rows [N, hidden], local expert ids [N]) → unweighted expert outputs [N, hidden], same order.
ExpertCompute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# route(x [T, hidden]) → (weights [T, k], expert ids [T, k]).
Route = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def sorted_pairs(weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert, weight) pairs of a routing, ordered by expert then token: the order
    transformers sums a token's expert outputs in (ascending expert), and grouped by owner rank."""
    tokens, k = experts.shape
    token = torch.arange(tokens, device=experts.device).repeat_interleave(k)
    expert = experts.reshape(-1)
    order = torch.argsort(expert * max(tokens, 1) + token)
    return token[order], expert[order], weights.reshape(-1)[order]


class ExpertDispatch:
    """Rank ``rank`` of an expert-parallel group of ``size``: see the module docstring."""

    def __init__(self, comm: ExpertCollective, rank: int, size: int, num_experts: int):
        self.comm = comm
        self.rank = rank
        self.size = size
        self.owned = expert_range(num_experts, size, rank)
        self.per_rank = len(self.owned)

    def __call__(self, x: torch.Tensor, route: Route, compute: ExpertCompute) -> torch.Tensor:
        sizes = token_chunks(x.shape[0], self.size)
        start = sum(sizes[:self.rank])
        mine = x[start:start + sizes[self.rank]]
        weights, experts = route(mine)
        token, expert, weight = sorted_pairs(weights, experts)
        send = torch.bincount(expert // self.per_rank, minlength=self.size)
        recv = torch.empty_like(send)
        self.comm.all_to_all(recv, send, None, None)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        rows = x.new_empty(sum(recv_splits), x.shape[1])
        self.comm.all_to_all(rows, mine.index_select(0, token), recv_splits, send_splits)
        their_experts = torch.empty(sum(recv_splits), dtype=expert.dtype, device=expert.device)
        self.comm.all_to_all(their_experts, expert, recv_splits, send_splits)
        done = compute(rows, their_experts - self.owned.start)
        back = x.new_empty(token.shape[0], x.shape[1])
        self.comm.all_to_all(back, done, send_splits, recv_splits)
        out = torch.zeros_like(x)
        out[start:start + sizes[self.rank]].index_add_(0, token, back * weight[:, None].to(back.dtype))
        self.comm.all_reduce(out)
        return out
