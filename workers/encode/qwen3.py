"""Qwen3-Omni's media encoders for the encode engine (:mod:`.encode`): same interface as
:class:`~omnirelay.workers.encode.engine.OmniEncoders`, different models and one more output.

Models: the thinker's ``visual`` (``Qwen3OmniMoeVisionEncoder``, patch 16, learned position grid
resampled per image) and ``audio_tower`` (``Qwen3OmniMoeAudioEncoder``: 100-frame chunks, three
stride-2 convolutions, windowed attention), built with transformers' own modules from the
checkpoint's config and the ``thinker.visual.*`` / ``thinker.audio_tower.*`` tensors; the language
model, talker and code2wav are never loaded here.

DeepStack: besides the merged image tokens the vision encoder emits one more ``[tokens, hidden]``
feature per ``deepstack_visual_indexes`` entry; the thinker adds feature ``i`` to the hidden states
of the image tokens after its decoder layer ``i``. The engine caches one tensor per image, so an
image's encoding here is ``[tokens, (1 + L) * hidden]`` (the merged tokens, then the L features side
by side) and :meth:`Qwen3OmniEncoders.image_payload` splits the request's images back into
``image_embeds [K, hidden]`` and ``image_deepstack [L, K, hidden]`` for the prefill.

Outputs equal what ``Qwen3OmniMoeThinkerForConditionalGeneration`` merges (tests compare greedy text).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omnirelay.mrope import qwen3_audio_output_length

from omnirelay.workers.encode.engine import ThinkerEncoders


class Qwen3OmniEncoders(ThinkerEncoders):
    """Qwen3-Omni's encoders (weights and preprocessing as every family's: :class:`ThinkerEncoders`)."""

    def __init__(self, path: str, dtype: torch.dtype = torch.float32):
        from transformers import Qwen3OmniMoeConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (Qwen3OmniMoeAudioEncoder,
                                                                                Qwen3OmniMoeVisionEncoder)

        raw = json.loads((Path(path) / "config.json").read_text())
        if "thinker_config" not in raw:
            raise ValueError(f"{path}: not a Qwen3-Omni checkpoint (no thinker_config)")
        thinker = Qwen3OmniMoeConfig.from_pretrained(path).thinker_config
        super().__init__(path, dtype, thinker, Qwen3OmniMoeVisionEncoder, Qwen3OmniMoeAudioEncoder)
        self.hidden = thinker.vision_config.out_hidden_size
        self.deepstack_layers = len(thinker.vision_config.deepstack_visual_indexes)
        self.n_window = thinker.audio_config.n_window

    # ---------------------------------------------------------------- encoders (batched)

    @torch.inference_mode()
    def encode_images(self, pixels: list[torch.Tensor], grids: list[list[int]]) -> list[torch.Tensor]:
        """Per image ``[tokens, (1 + L) * hidden]``: merged tokens, then the L DeepStack features."""
        grid = torch.tensor(grids, dtype=torch.long)
        out = self.visual(torch.cat(pixels).to(self.dtype), grid_thw=grid)
        joint = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
        return list(torch.split(joint, (grid.prod(-1) // self.merge ** 2).tolist()))

    @torch.inference_mode()
    def encode_audio(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        lens = torch.tensor([f.shape[1] for f in features], dtype=torch.long)
        out = self.audio(torch.cat(features, dim=1).to(self.dtype), feature_lens=lens).last_hidden_state
        return list(torch.split(out, [qwen3_audio_output_length(int(n), self.n_window) for n in lens]))

    def image_payload(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """A request's images ``[K, (1 + L) * hidden]`` → ``image_embeds [K, hidden]`` and
        ``image_deepstack [L, K, hidden]``."""
        k = images.shape[0]
        deep = images[:, self.hidden:].reshape(k, self.deepstack_layers, self.hidden)
        return {"image_embeds": images[:, : self.hidden].contiguous(),
                "image_deepstack": deep.transpose(0, 1).contiguous()}
