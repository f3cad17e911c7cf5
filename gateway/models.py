"""What the gateway knows about each served model: tokenizer, chat template, context length and
the stages of its pipeline. Loaded once at start-up from the model directory. And the lookup of a
request's ``model`` in the served table (:func:`served_model`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from transformers import AutoTokenizer

from omnirelay.errors import NotFound, Unprocessable
from omnirelay.model_kind import ModelKind, model_kind

from .config import ServedModel
from .media import MediaLimits, MediaProcessor


class ModelRuntime:
    """``media``: the media rules of a model that takes images and audio (Qwen2.5-Omni), else None."""

    def __init__(self, served: ServedModel, media_limits: MediaLimits | None = None):
        self.name = served.name
        self.path = served.path
        self.stages = tuple(served.stages)
        self.tokenizer = AutoTokenizer.from_pretrained(served.path)
        config = json.loads((Path(served.path) / "config.json").read_text())
        kind = model_kind(served.path)
        self.media = None
        if kind.is_omni:   # the thinker's LM sets the limits
            limits = media_limits or MediaLimits(allowed_local_dir=served.allowed_local_media_path)
            self.media = MediaProcessor(served.path, limits)
            config = config["thinker_config"]["text_config"]
        elif kind is ModelKind.QWEN3_TTS:   # speech only: the text vocabulary, the talker's context
            talker = config["talker_config"]
            config = {"vocab_size": talker["text_vocab_size"],
                      "max_position_embeddings": talker.get("max_position_embeddings", 2048)}
        self.vocab_size = int(config["vocab_size"])
        model_max = int(config.get("max_position_embeddings", 2048))
        self.max_model_len = min(served.max_model_len or model_max, model_max)
        self.created = int(Path(served.path).stat().st_mtime)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """``tools``: OpenAI function tools, rendered by the model's chat template."""
        text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return self.encode_text(text)

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "omnirelay",
                "root": self.path, "max_model_len": self.max_model_len}


M = TypeVar("M")


def served_model(models: dict, name: str, kind: type[M], wrong_kind: str) -> M:
    """The served model ``name`` (the app's model table), which must be a ``kind``: 404 if none is
    served by that name, 422 saying ``wrong_kind`` if it is another kind."""
    model = models.get(name)
    if model is None:
        raise NotFound(f"model {name!r} does not exist; see GET /v1/models", param="model")
    if not isinstance(model, kind):
        raise Unprocessable(wrong_kind, param="model")
    return model


def text_model(models: dict, name: str) -> ModelRuntime:
    """The served text model ``name``: 404 if none, 422 for an image or video pipeline."""
    return served_model(models, name, ModelRuntime,
                        f"model {name!r} generates images; use POST /v1/images/generations")
