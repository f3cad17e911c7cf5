"""What a model directory holds, decided in one place from its own metadata (nothing is imported).

The launchers pick a model's bundled pipeline by it, the worker daemon its role's engine, the
gateway the limits and routes a model gets::

    model_index.json (diffusers)    its ``_class_name`` makes video  -> text-to-video
                                    any other pipeline class         -> text-to-image
    config.json ``model_type``      qwen2_5_omni                     -> omni (Qwen2.5-Omni)
                                    qwen3_omni_moe                   -> qwen3-omni
                                    qwen3_tts                        -> qwen3-tts
                                    anything else                    -> llm (a causal LM)

A directory with neither file is an ``llm`` here; loading it fails later with the loader's own
message, which names the missing file.
"""

from __future__ import annotations

import enum
import json
import os

from .video_params import is_video_class


class ModelKind(enum.StrEnum):
    LLM = "llm"
    OMNI = "omni"
    QWEN3_OMNI = "qwen3-omni"
    QWEN3_TTS = "qwen3-tts"
    TEXT_TO_IMAGE = "text-to-image"
    TEXT_TO_VIDEO = "text-to-video"

    @property
    def is_omni(self) -> bool:
        """A thinker that takes images and audio and a talker that speaks (Qwen2.5-Omni, Qwen3-Omni)."""
        return self in (ModelKind.OMNI, ModelKind.QWEN3_OMNI)


_BY_MODEL_TYPE = {"qwen2_5_omni": ModelKind.OMNI, "qwen3_omni_moe": ModelKind.QWEN3_OMNI,
                  "qwen3_tts": ModelKind.QWEN3_TTS}


def model_kind(model_dir: str | os.PathLike) -> ModelKind:
    index = read_json(os.path.join(model_dir, "model_index.json"))
    if index is not None:
        name = str(index.get("_class_name", ""))
        return ModelKind.TEXT_TO_VIDEO if is_video_class(name) else ModelKind.TEXT_TO_IMAGE
    config = read_json(os.path.join(model_dir, "config.json")) or {}
    return _BY_MODEL_TYPE.get(config.get("model_type"), ModelKind.LLM)


def read_json(path: str | os.PathLike) -> dict | None:
    """A JSON object file's content; None when it is missing, unreadable or not an object."""
    try:
        with open(path) as handle:
            value = json.load(handle)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
