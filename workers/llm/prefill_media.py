"""Where a multimodal prompt's encoder outputs go in the prefill forward.

The encode stage's payload (``image_embeds``, ``audio_embeds`` and, for Qwen3-Omni, the DeepStack
``image_deepstack``) is placed once, at admission (:func:`place_media`): the placeholder rows that
take an embedding, the prompt's 3-row M-RoPE positions and its rope delta
(:mod:`~omnirelay.mrope`). Each chunk's forward then takes its slice (:func:`media_fields`); a text
prompt packed beside a media one repeats its plain positions on the three rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from omnirelay.connectors.base import Payload
from omnirelay.handoffs import EmbedsHandoff
from omnirelay.mrope import MropeSpec, mrope_positions


@dataclasses.dataclass
class PlacedMedia:
    """A multimodal prompt's extras, resolved at admission."""

    rope: torch.Tensor           # [3, n] M-RoPE positions of the prompt
    rope_delta: int              # decode positions are token index + this
    index: torch.Tensor          # [K] prompt rows taking an encoder output, ascending
    embeds: torch.Tensor         # [K, hidden] in the same order
    key: str                     # the encoder outputs' connector key, deleted when the prefill ends
    # Qwen3-Omni's DeepStack: the image rows (ascending) and the features added to them after the
    # first decoder layers, [L, V, hidden]; None for other models and prompts without images.
    deep_index: torch.Tensor | None = None
    deep: torch.Tensor | None = None


def place_media(prompt_token_ids: list[int], media: EmbedsHandoff, payload: Payload, mrope: MropeSpec,
                hidden_size: int) -> PlacedMedia:
    """Place the encoder outputs: placeholder rows, M-RoPE positions, rope delta. ValueError when
    the payload does not match the prompt's placeholders."""
    ids = torch.tensor(prompt_token_ids)
    rows, values = [], []
    for token, name in ((mrope.image_token_id, "image_embeds"), (mrope.audio_token_id, "audio_embeds")):
        where = torch.nonzero(ids == token).flatten()
        embeds = payload.get(name)
        count = 0 if embeds is None else embeds.shape[0]
        if count != len(where):
            raise ValueError(f"{len(where)} placeholder tokens for {count} encoder outputs ({name})")
        if count:
            rows.append(where)
            values.append(embeds)
    rope, delta = mrope_positions(prompt_token_ids, mrope, [list(g) for g in media.image_grids],
                                  list(media.audio_lengths))
    index = torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)
    order = torch.argsort(index)
    embeds = torch.cat(values)[order] if values else torch.empty(0, hidden_size)
    deep_index, deep = None, payload.get("image_deepstack")
    if deep is not None:
        deep_index = torch.nonzero(ids == mrope.image_token_id).flatten()
        if deep.dim() != 3 or deep.shape[1] != len(deep_index):
            raise ValueError(f"DeepStack features {tuple(deep.shape)} for {len(deep_index)} image tokens")
    return PlacedMedia(rope, delta, index[order], embeds, media.mm_key, deep_index, deep)


def media_fields(chunks: Sequence[tuple[PlacedMedia | None, int, int]]) -> dict:
    """ForwardBatch extras for a step with multimodal prompts, from each packed chunk's
    ``(media or None, first prompt position, token count)``: 3-row rotary positions for every
    packed token and the embeddings (and DeepStack features) at placeholder rows. Empty when no
    chunk has media."""
    if not any(media is not None for media, _, _ in chunks):
        return {}
    rope, index, values, offset = [], [], [], 0
    deep_rows, deep_values = [], []
    for media, lo, n in chunks:
        hi = lo + n
        if media is None:
            rope.append(torch.arange(lo, hi).expand(3, n))
        else:
            rope.append(media.rope[:, lo:hi])
            inside = (media.index >= lo) & (media.index < hi)
            index.append(media.index[inside] - lo + offset)
            values.append(media.embeds[inside])
            if media.deep is not None:
                inside = (media.deep_index >= lo) & (media.deep_index < hi)
                deep_rows.append(media.deep_index[inside] - lo + offset)
                deep_values.append(media.deep[:, inside])
        offset += n
    fields = {"rope_positions": torch.cat(rope, dim=1)}
    if index:
        fields["embeds"] = (torch.cat(index), torch.cat(values))
    if deep_rows:
        fields["deepstack"] = (torch.cat(deep_rows), torch.cat(deep_values, dim=1))
    return fields
