"""Multimodal rotary positions (M-RoPE) of a Qwen2.5-Omni prompt, and what a request carries for them.

Where this sits in a request's life: the gateway expands each media placeholder to one token per
encoder output; the encode stage reports each image's patch grid and each audio clip's feature
length; the prefill engine calls :func:`mrope_positions` once per prompt to get the 3-row
(temporal, height, width) rotary positions of every prompt token and the request's *rope delta*;
every later token (decode) sits at ``token index + rope delta`` on all three axes.

The rules are transformers' ``Qwen2_5OmniPreTrainedModelForConditionalGeneration.get_rope_index``
for images and audio (video is not served), which Qwen3-Omni's ``get_rope_index`` repeats; only its
count of audio tokens per clip differs (100-frame chunks of 13 tokens, :meth:`MropeSpec.audio_tokens`): text advances all three axes together; an image's
tokens sit on a ``grid_h/merge x grid_w/merge`` lattice offset from the position after its
``<|vision_bos|>`` (temporal axis ``t * position_id_per_seconds``); an audio clip's tokens are
consecutive; the next text starts one past the largest position used so far. As in transformers,
a prompt without images gets plain positions (its audio positions are consecutive anyway).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class MropeSpec:
    """The model's constants for :func:`mrope_positions` (from the thinker config)."""

    image_token_id: int
    audio_token_id: int
    spatial_merge_size: int = 2
    position_id_per_seconds: int = 25
    audio_n_window: int = 0     # Qwen3-Omni: its audio encoder's chunk half-width (0: Qwen2.5-Omni's rule)

    @classmethod
    def from_config(cls, raw: dict) -> "MropeSpec | None":
        """From a checkpoint's config.json map; None for a model without media inputs."""
        thinker = raw.get("thinker_config", raw)
        if "vision_config" not in thinker:
            return None
        qwen3 = raw.get("model_type") == "qwen3_omni_moe"
        return cls(image_token_id=int(thinker.get("image_token_index", thinker.get("image_token_id"))),
                   audio_token_id=int(thinker.get("audio_token_index", thinker.get("audio_token_id"))),
                   spatial_merge_size=int(thinker["vision_config"].get("spatial_merge_size", 2)),
                   position_id_per_seconds=int(thinker.get("position_id_per_seconds", 25)),
                   audio_n_window=int(thinker.get("audio_config", {}).get("n_window", 50)) if qwen3 else 0)

    def audio_tokens(self, feature_len: int) -> int:
        """Audio placeholder tokens of a clip of ``feature_len`` mel frames, by this model's rule."""
        if self.audio_n_window:
            return qwen3_audio_output_length(feature_len, self.audio_n_window)
        return audio_output_length(feature_len)


def audio_output_length(feature_len: int) -> int:
    """Audio encoder outputs (= <|AUDIO|> tokens) for ``feature_len`` mel frames (two stride-2 steps)."""
    return ((feature_len - 1) // 2 + 1 - 2) // 2 + 1


def qwen3_audio_output_length(feature_len: int, n_window: int) -> int:
    """Qwen3-Omni's audio encoder outputs for ``feature_len`` mel frames: each full chunk of
    ``2 * n_window`` frames gives 13, the remainder three stride-2 convolutions' worth
    (transformers' ``_get_feat_extract_output_lengths`` of Qwen3-Omni)."""
    chunk = n_window * 2
    after = (feature_len % chunk - 1) // 2 + 1
    return ((after - 1) // 2 + 1 - 1) // 2 + 1 + (feature_len // chunk) * 13


def mrope_positions(token_ids: list[int], spec: MropeSpec, image_grids: list[list[int]],
                    audio_lengths: list[int]) -> tuple[torch.Tensor, int]:
    """``(positions [3, n] int64, rope_delta)`` for one prompt. ``image_grids``: (t, h, w) patch grid
    per image in prompt order; ``audio_lengths``: mel frames per audio clip in prompt order."""
    n = len(token_ids)
    if not image_grids:
        return torch.arange(n).expand(3, n).clone(), 0
    ids = torch.tensor(token_ids)
    is_image, is_audio = ids == spec.image_token_id, ids == spec.audio_token_id
    parts: list[torch.Tensor] = []
    next_pos = 0   # one past the largest position used so far
    st = image_idx = audio_idx = 0

    def text(length: int) -> None:
        nonlocal next_pos
        if length > 0:
            parts.append(torch.arange(length).expand(3, length) + next_pos)
            next_pos += length

    while st < n:
        rest_image = torch.nonzero(is_image[st:])
        rest_audio = torch.nonzero(is_audio[st:])
        ed_image = st + int(rest_image[0]) if len(rest_image) and image_idx < len(image_grids) else n + 1
        ed_audio = st + int(rest_audio[0]) if len(rest_audio) and audio_idx < len(audio_lengths) else n + 1
        ed = min(ed_image, ed_audio)
        if ed > n:
            break
        text(ed - st - 1)   # text before the media's bos token
        text(1)             # its bos token
        if ed == ed_audio:
            length = spec.audio_tokens(audio_lengths[audio_idx])
            text(length)    # audio tokens advance like text
            audio_idx += 1
        else:
            t, h, w = image_grids[image_idx]
            merge = spec.spatial_merge_size
            gh, gw = h // merge, w // merge
            t_index = (torch.arange(t) * spec.position_id_per_seconds).view(-1, 1).expand(-1, gh * gw).flatten()
            h_index = torch.arange(gh).view(1, -1, 1).expand(t, -1, gw).flatten()
            w_index = torch.arange(gw).view(1, 1, -1).expand(t, gh, -1).flatten()
            block = torch.stack([t_index, h_index, w_index]) + next_pos
            parts.append(block)
            next_pos = int(block.max()) + 1
            length = t * gh * gw
            image_idx += 1
        text(1)             # its eos token
        st = ed + length + 1
    text(n - st)
    positions = torch.cat(parts, dim=1)
    if positions.shape[1] != n:
        raise ValueError(f"media placeholders do not match the encoder outputs ({positions.shape[1]} positions "
                         f"for {n} tokens)")
    return positions, int(positions.max()) + 1 - n
