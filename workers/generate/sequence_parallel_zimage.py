"""Sequence parallelism for Z-Image's single-stream transformer, with the design of the SD3 kernel
(:mod:`.sequence_parallel`): tokens split across the ranks, K/V all-gathered per attention.

Life of one denoising forward on rank ``r`` of ``world`` (:func:`zimage_sequence_parallel_forward`)::

    latents, caption features (every rank, whole) ──patchify + embed──▶ image tokens, caption tokens
        ──noise refiner (image) and context refiner (caption), whole on every rank──▶
        unified sequence per sample [image tokens, caption tokens] (padded to the batch's longest,
        a key mask when lengths differ) ──padded to a multiple of world──▶
        ──keep tokens [r·L/world, (r+1)·L/world) and their RoPE rows──▶ local tokens
    per main layer: local q, k, v (per-head RMS norm, RoPE of their own positions)
        ──all_gather k, v──▶ local queries over ALL keys (padding masked out); modulation and FFN token-local
    final layer on local tokens ──all_gather──▶ L tokens ──drop the padding, unpatchify──▶ noise prediction

The refiners (1–2 layers each side, against 30 main layers in Z-Image-Turbo) run whole on every
rank, which keeps their per-stream masks as the model has them; the main layers — the bulk of the
work — run 1/world of the tokens each. The result equals the single-rank forward up to float
rounding, which ``tests/engine/test_sequence_parallel_dit.py`` checks with prompts of different lengths.

Scope: :class:`diffusers.ZImageTransformer2DModel` in text-to-image mode (no Omni/SigLIP inputs, no
ControlNet residuals). Any token count works: the sequence is padded to split evenly. A generate
worker runs it over its ranks with ``--sequence-parallel-size N`` (:mod:`.sequence_parallel_group`,
:mod:`.sequence_parallel_kernels`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from omnirelay.workers.generate.sequence_parallel import gather_tokens


class SequenceParallelZImageAttnProcessor:
    """Z-Image's single-stream attention with the sequence split across ranks: queries stay local,
    keys and values are gathered; ``attention_mask`` is the whole sequence's key mask."""

    def __init__(self, group=None):
        self.group = group

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, freqs_cis: torch.Tensor | None = None) -> torch.Tensor:
        query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
        key = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if freqs_cis is not None:
            query, key = _rotate(query, freqs_cis), _rotate(key, freqs_cis)
        # (batch, tokens, heads, dim): tokens are dim 1, as gather_tokens expects
        key, value = gather_tokens(key, self.group), gather_tokens(value, self.group)
        mask = attention_mask[:, None, None, :] if attention_mask is not None else None
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                             attn_mask=mask, dropout_p=0.0, is_causal=False).transpose(1, 2)
        out = attn.to_out[0](out.flatten(2, 3).to(query.dtype))
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def _rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Z-Image's complex RoPE on ``(batch, tokens, heads, dim)`` (as ``ZSingleStreamAttnProcessor``)."""
    rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * freqs_cis.unsqueeze(2)
    return torch.view_as_real(rotated).flatten(3).type_as(x)


@contextlib.contextmanager
def _main_layer_processors(model, processor):
    """Install ``processor`` on the main layers' attention (not the refiners') for the duration."""
    saved = [(layer.attention, layer.attention.processor) for layer in model.layers]
    for attention, _ in saved:
        attention.set_processor(processor)
    try:
        yield
    finally:
        for attention, original in saved:
            attention.set_processor(original)


@torch.inference_mode()
def zimage_sequence_parallel_forward(model, x: list[torch.Tensor], t: torch.Tensor, cap_feats: list[torch.Tensor],
                                     patch_size: int = 2, f_patch_size: int = 1, group=None) -> list[torch.Tensor]:
    """``model(x, t, cap_feats).sample`` (a list: one prediction per latent) computed by every rank
    of ``group`` together; every rank passes the same inputs and gets the whole output."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = x[0].device
    key = f"{patch_size}-{f_patch_size}"
    adaln = model.t_embedder(t * model.t_scale).type_as(x[0])
    x, cap_feats, x_size, x_pos_ids, cap_pos_ids, x_pad_mask, cap_pad_mask = model.patchify_and_embed(
        x, cap_feats, patch_size, f_patch_size)
    x_lens = [len(item) for item in x]
    image = model.all_x_embedder[key](torch.cat(x, dim=0))
    image, image_freqs, image_mask, _, _ = model._prepare_sequence(
        list(image.split(x_lens, dim=0)), x_pos_ids, x_pad_mask, model.x_pad_token, None, device)
    for layer in model.noise_refiner:
        image = layer(image, image_mask, image_freqs, adaln, None, None, None)
    cap_lens = [len(item) for item in cap_feats]
    caption = model.cap_embedder(torch.cat(cap_feats, dim=0))
    caption, cap_freqs, cap_mask, _, _ = model._prepare_sequence(
        list(caption.split(cap_lens, dim=0)), cap_pos_ids, cap_pad_mask, model.cap_pad_token, None, device)
    for layer in model.context_refiner:
        caption = layer(caption, cap_mask, cap_freqs)
    unified, freqs, mask, _ = model._build_unified_sequence(
        image, image_freqs, x_lens, None, caption, cap_freqs, cap_lens, None, None, None, None, None, False, device)
    batch, length = unified.shape[:2]
    pad = -length % world
    if pad:   # padded keys are masked out; padded queries are dropped after the gather
        if mask is None:
            mask = torch.ones(batch, length, dtype=torch.bool, device=device)
        mask = F.pad(mask, (0, pad), value=False)
        unified = torch.cat([unified, unified.new_zeros(batch, pad, unified.shape[2])], dim=1)
        freqs = torch.cat([freqs, freqs.new_zeros(batch, pad, freqs.shape[2])], dim=1)
    local = unified.chunk(world, dim=1)[rank]
    local_freqs = freqs.chunk(world, dim=1)[rank]
    with _main_layer_processors(model, SequenceParallelZImageAttnProcessor(group)):
        for layer in model.layers:
            local = layer(local, mask, local_freqs, adaln, None, None, None)
    out = gather_tokens(model.all_final_layer[key](local, c=adaln), group)[:, :length]
    return model.unpatchify(list(out.unbind(dim=0)), x_size, patch_size, f_patch_size, None)
