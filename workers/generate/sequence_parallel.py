"""Sequence parallelism for a diffusion transformer: the image tokens split across the ranks of a group.

Life of one denoising forward on rank ``r`` of ``world`` (:func:`sequence_parallel_forward`)::

    latents (every rank, whole) ──patch embed + positions──▶ N tokens
        ──keep tokens [r·N/world, (r+1)·N/world)──▶ local tokens
    per transformer block: local q, k, v ──all_gather k, v over the group──▶ attention of the
        local queries over ALL image keys (+ the prompt's keys, which every rank holds whole)
        ──▶ local tokens out (the prompt stream is computed whole on every rank)
    final norm + projection on local tokens ──all_gather──▶ N tokens ──unpatchify──▶ noise prediction

Each rank holds 1/world of the activations and computes 1/world of the token-wise work (MLPs,
projections, the attention's queries); the price is one all-gather of K and V per block. The
result equals the single-rank forward up to float rounding (attention sums the same keys in the
same order; only the query batch differs), which ``tests/engine/test_sequence_parallel.py`` checks.

Scope: the MMDiT transformer of Stable Diffusion 3 (:class:`diffusers.SD3Transformer2DModel`,
joint attention, no dual attention, no skip layers, no ControlNet residuals). The token count
(``(H/patch)·(W/patch)``) must divide by the group size. This module is the kernel of SP for SD3
(Z-Image's and Wan's are :mod:`.sequence_parallel_zimage` and :mod:`.sequence_parallel_wan`); a
generate worker runs it over its ranks with ``--sequence-parallel-size N``
(:mod:`omnirelay.workers.generate.sequence_parallel_group`: rank 0 broadcasts each forward's inputs to
ranks 1..N-1, which follow the pipeline's denoising loop call by call).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F


def gather_tokens(local: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's ``(batch, tokens, …)`` slice along the token dimension, in rank order."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=1)


class SequenceParallelJointAttnProcessor:
    """diffusers' ``JointAttnProcessor2_0`` with the image stream split across ranks: keys and
    values of the image tokens are gathered before attention, queries stay local."""

    def __init__(self, group=None):
        self.group = group

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *args, **kwargs):
        if attention_mask is not None:
            raise ValueError("sequence-parallel joint attention takes no attention mask")
        batch, local_tokens = hidden_states.shape[:2]

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, -1, attn.heads, x.shape[-1] // attn.heads).transpose(1, 2)

        query, key, value = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), \
            heads(attn.to_v(hidden_states))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        # (batch, heads, tokens, dim): gather along the token axis (dim 2) via a transpose.
        key = gather_tokens(key.transpose(1, 2), self.group).transpose(1, 2)
        value = gather_tokens(value.transpose(1, 2), self.group).transpose(1, 2)
        if encoder_hidden_states is not None:
            context_query = heads(attn.add_q_proj(encoder_hidden_states))
            context_key = heads(attn.add_k_proj(encoder_hidden_states))
            context_value = heads(attn.add_v_proj(encoder_hidden_states))
            if attn.norm_added_q is not None:
                context_query = attn.norm_added_q(context_query)
            if attn.norm_added_k is not None:
                context_key = attn.norm_added_k(context_key)
            query = torch.cat([query, context_query], dim=2)
            key = torch.cat([key, context_key], dim=2)
            value = torch.cat([value, context_value], dim=2)
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(batch, -1, out.shape[1] * out.shape[-1]).to(query.dtype)
        if encoder_hidden_states is not None:
            out, encoder_hidden_states = out[:, :local_tokens], out[:, local_tokens:]
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        out = attn.to_out[1](attn.to_out[0](out))
        return (out, encoder_hidden_states) if encoder_hidden_states is not None else out


@contextlib.contextmanager
def _processors(model, processor):
    """Install ``processor`` on every attention layer for the duration; restore the originals."""
    saved = model.attn_processors
    model.set_attn_processor(processor)
    try:
        yield
    finally:
        model.set_attn_processor(saved)


@torch.inference_mode()
def sequence_parallel_forward(model, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                              pooled_projections: torch.Tensor, timestep: torch.Tensor, group=None) -> torch.Tensor:
    """``model(hidden_states, encoder_hidden_states, pooled_projections, timestep).sample`` computed
    by every rank of ``group`` together; every rank passes the same inputs and gets the whole output."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    height, width = hidden_states.shape[-2:]
    patch = model.config.patch_size
    tokens = model.pos_embed(hidden_states)
    if tokens.shape[1] % world:
        raise ValueError(f"{tokens.shape[1]} image tokens do not split over {world} ranks")
    local = tokens.chunk(world, dim=1)[rank].contiguous()
    temb = model.time_text_embed(timestep, pooled_projections)
    context = model.context_embedder(encoder_hidden_states)
    with _processors(model, SequenceParallelJointAttnProcessor(group)):
        for block in model.transformer_blocks:
            context, local = block(hidden_states=local, encoder_hidden_states=context, temb=temb)
    local = model.proj_out(model.norm_out(local, temb))
    out = gather_tokens(local, group)
    batch, channels = out.shape[0], model.out_channels
    out = out.reshape(batch, height // patch, width // patch, patch, patch, channels)
    out = torch.einsum("nhwpqc->nchpwq", out)
    return out.reshape(batch, channels, height, width)
