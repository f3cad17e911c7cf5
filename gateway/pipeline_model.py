"""A served diffusers pipeline as the gateway knows it: name, stages and model card, and the lookup
of a request's ``model`` among the served ones. :class:`~.routes.images.ImageModel` and
:class:`~.routes.videos.VideoModel` differ only in what they make and in what they add to this."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from omnirelay.errors import BadRequest

from .config import ServedModel
from .models import served_model

M = TypeVar("M", bound="PipelineModel")


class PipelineModel:
    # Set by each kind, for its messages: "a {what}", "{noun} models", "does not generate {makes}",
    # and the pipeline file that gives it a generate stage.
    what = "diffusers pipeline"
    noun = ""
    makes = ""
    pipeline_file = ""

    def __init__(self, served: ServedModel):
        if "generate" not in served.stages:
            raise ValueError(f"model {served.name!r} ({served.path}) is a {self.what}, but its stages "
                             f"{list(served.stages)} have no 'generate'; serve it with a pipeline file such as "
                             f"{self.pipeline_file}")
        self.name = served.name
        self.path = served.path
        self.stages = tuple(served.stages)
        index = json.loads((Path(served.path) / "model_index.json").read_text())
        self.pipeline_class = str(index.get("_class_name", ""))
        self.created = int(Path(served.path).stat().st_mtime)

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "omnirelay",
                "root": self.path, "pipeline": self.pipeline_class}

    @classmethod
    def find(cls: type[M], models: dict, name: str | None) -> M:
        """The served model ``name``, which must be of this kind; without a name, the only one of
        this kind."""
        if name is None:
            mine = [m for m in models.values() if isinstance(m, cls)]
            if len(mine) != 1:
                raise BadRequest(f"'model' is required (this gateway serves {len(mine)} {cls.noun} models)",
                                 param="model")
            return mine[0]
        return served_model(models, name, cls, f"model {name!r} does not generate {cls.makes}")
