"""Sequence parallelism for Wan's video transformer: the video tokens split across the ranks of a
group, with the design of the SD3 kernel (:mod:`.sequence_parallel`).

Life of one denoising forward on rank ``r`` of ``world`` (:func:`wan_sequence_parallel_forward`)::

    latents (every rank, whole) ──3D patch embed──▶ N video tokens (+ their 3-axis RoPE table)
        ──padded to L, a multiple of world (when N is not)──▶
        ──keep tokens [r·L/world, (r+1)·L/world) and their RoPE rows──▶ local tokens
    per block: self-attention — local q, k, v (RMS norm across heads, RoPE of their own positions)
                   ──all_gather k, v over the group──▶ local queries over ALL video keys (padding masked out)
               cross-attention on the prompt (every rank holds it whole) and the FFN: token-local
    output norm + projection on local tokens ──all_gather──▶ L tokens ──drop the padding, unpatchify──▶
        noise prediction

Each rank computes 1/world of the token-wise work; the price is one all-gather of K and V per
block. The result equals the single-rank forward up to float rounding (the same keys in the same
order; only the query batch differs), which ``tests/engine/test_sequence_parallel_dit.py`` checks.

Scope: :class:`diffusers.WanTransformer3DModel` for text to video — one timestep per sample (not
the TI2V-5B per-token timesteps) and no image conditioning. Both experts of Wan 2.2 A14B are this
class, so each runs through this kernel. Any token count ``(F/p_t)·(H/p_h)·(W/p_w)`` works: the
sequence is padded to split evenly (zero tokens whose keys attention masks out and whose outputs
are dropped). A generate worker runs it over its ranks with ``--sequence-parallel-size N``
(:mod:`.sequence_parallel_group`, :mod:`.sequence_parallel_kernels`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from omnirelay.workers.generate.sequence_parallel import gather_tokens


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on ``(batch, tokens, heads, dim)`` (as ``WanAttnProcessor`` applies it)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class SequenceParallelWanSelfAttnProcessor:
    """Wan's self-attention with the video tokens split across ranks: queries stay local, keys
    and values of every rank's tokens are gathered before attention."""

    def __init__(self, group=None, key_mask: torch.Tensor | None = None):
        """``key_mask``: ``(1, 1, 1, tokens)`` bool over the whole padded sequence, False on padding;
        None: no padding."""
        self.group = group
        self.key_mask = key_mask

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb=None) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("the sequence-parallel Wan processor serves self-attention without a mask only")
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)     # across heads, per token: local
        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = _rotate(query, *rotary_emb), _rotate(key, *rotary_emb)
        # (batch, tokens, heads, dim): tokens are dim 1, as gather_tokens expects
        key, value = gather_tokens(key, self.group), gather_tokens(value, self.group)
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                             attn_mask=self.key_mask, dropout_p=0.0, is_causal=False).transpose(1, 2)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


@contextlib.contextmanager
def _self_attention_processors(model, processor):
    """Install ``processor`` on every block's self-attention (``attn1``) for the duration."""
    saved = model.attn_processors
    model.set_attn_processor({name: processor if ".attn1." in name else proc for name, proc in saved.items()})
    try:
        yield
    finally:
        model.set_attn_processor(saved)


@torch.inference_mode()
def wan_sequence_parallel_forward(model, hidden_states: torch.Tensor, timestep: torch.Tensor,
                                  encoder_hidden_states: torch.Tensor, group=None) -> torch.Tensor:
    """``model(hidden_states, timestep, encoder_hidden_states).sample`` computed by every rank of
    ``group`` together; every rank passes the same inputs and gets the whole output."""
    if timestep.ndim != 1:
        raise ValueError("sequence-parallel Wan takes one timestep per sample (not TI2V's per-token ones)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    batch, _, frames, height, width = hidden_states.shape
    p_t, p_h, p_w = model.config.patch_size
    cos, sin = model.rope(hidden_states)                       # (1, N, 1, dim): every position
    tokens = model.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
    length = tokens.shape[1]
    pad = -length % world
    key_mask = None
    if pad:   # padded keys are masked out; padded queries are dropped after the gather
        tokens = F.pad(tokens, (0, 0, 0, pad))
        cos, sin = F.pad(cos, (0, 0, 0, 0, 0, pad)), F.pad(sin, (0, 0, 0, 0, 0, pad))
        key_mask = (torch.arange(length + pad, device=tokens.device) < length).view(1, 1, 1, -1)
    local = tokens.chunk(world, dim=1)[rank].contiguous()
    rotary = (cos.chunk(world, dim=1)[rank], sin.chunk(world, dim=1)[rank])
    temb, timestep_proj, context, _ = model.condition_embedder(timestep, encoder_hidden_states, None,
                                                               timestep_seq_len=None)
    timestep_proj = timestep_proj.unflatten(1, (6, -1))
    with _self_attention_processors(model, SequenceParallelWanSelfAttnProcessor(group, key_mask)):
        for block in model.blocks:
            local = block(local, context, timestep_proj, rotary)
    shift, scale = (model.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
    local = (model.norm_out(local.float()) * (1 + scale) + shift).type_as(local)
    out = gather_tokens(model.proj_out(local), group)[:, :length]
    out = out.reshape(batch, frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
    return out.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)
