"""Which pipeline each served model runs, decided once by the launchers (``omni-serve``, Ray).

A model directory says what it is: a diffusers ``model_index.json`` names a text-to-image or
text-to-video pipeline class; an HF ``config.json`` with ``model_type: qwen2_5_omni`` is an omni
model (encode → prefill → decode → generate), ``qwen3_omni_moe`` a Qwen3-Omni one (the same
stages: its encoders, MoE thinker, talker + code2wav), ``qwen3_tts`` a Qwen3-TTS speech model (one
generate stage: text in, audio out); anything else is a causal LM (prefill → decode). Each
kind has a stage-pipeline file bundled in ``deploy/pipelines/``; ``--stage-configs-path`` overrides
it, once for all models or once per model in order.

A causal LM without an explicit file keeps ``pipeline_file=None``: its workers then build the
prefill → decode pipeline themselves around ``--connector``, so that one flag still moves the KV
handoff to another backend.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from omnirelay.video_params import is_video_class

from omnirelay.pipeline import Pipeline, PipelineError, default_llm_pipeline, load_pipeline

BUNDLED = Path(__file__).resolve().parent / "pipelines"
# Bundled pipeline per model kind, best first: a kind may have a richer pipeline that a build lacks.
PIPELINES_BY_KIND = {
    "text-to-image": ("text_to_image.yaml",),
    "text-to-video": ("text_to_video.yaml",),
    "omni": ("omni.yaml", "omni_thinker.yaml"),
    "qwen3-omni": ("qwen3_omni.yaml", "qwen3_omni_thinker.yaml"),
    "qwen3-tts": ("qwen3_tts.yaml",),
}


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """One served model as the launchers start it.

    path:           absolute model directory.
    name:           the id clients send in ``model``.
    kind:           ``llm``, ``omni``, ``qwen3-omni``, ``qwen3-tts``, ``text-to-image`` or ``text-to-video`` (see :func:`model_kind`).
    pipeline:       its stages, connectors and edges.
    pipeline_file:  the YAML its workers and the gateway load (``None``: the default LM pipeline).
    groups:         role → (tensor, pipeline) parallel size of one worker of that role.
    """

    path: str
    name: str
    kind: str
    pipeline: Pipeline
    pipeline_file: str | None
    groups: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

    @property
    def roles(self) -> tuple[str, ...]:
        return self.pipeline.roles

    def pipeline_args(self) -> list[str]:
        return ["--stage-configs-path", self.pipeline_file] if self.pipeline_file else []


def model_kind(model_dir: str) -> str:
    """What a model directory holds, from its own metadata files (nothing is imported)."""
    index = _read_json(os.path.join(model_dir, "model_index.json"))
    if index is not None:
        name = str(index.get("_class_name", ""))
        return "text-to-video" if is_video_class(name) else "text-to-image"
    config = _read_json(os.path.join(model_dir, "config.json")) or {}
    if config.get("model_type") == "qwen2_5_omni":
        return "omni"
    if config.get("model_type") == "qwen3_omni_moe":
        return "qwen3-omni"
    if config.get("model_type") == "qwen3_tts":
        return "qwen3-tts"
    return "llm"


def bundled_pipeline(kind: str) -> str | None:
    """The bundled pipeline file for ``kind``; None for a causal LM (its workers build the default)."""
    if kind == "llm":
        return None
    for name in PIPELINES_BY_KIND[kind]:
        if (BUNDLED / name).is_file():
            return str(BUNDLED / name)
    raise PipelineError(f"no bundled pipeline for {kind} models in this build (looked for "
                        f"{', '.join(PIPELINES_BY_KIND[kind])} in {BUNDLED}); give --stage-configs-path")


def plan_models(models: list[tuple[str, str]], pipeline_files: list[str] | None,
                connector: str = "shared_memory") -> list[ModelPlan]:
    """Resolve each (directory, served name) to its pipeline. ``pipeline_files``: none (each model's
    bundled pipeline), one for every model, or one per model. Raises PipelineError naming the file."""
    files = [os.path.abspath(f) for f in pipeline_files or []]
    if len(files) not in (0, 1, len(models)):
        raise PipelineError(f"{len(files)} --stage-configs-path for {len(models)} models: give one for all "
                            "models or one per model, in the same order")
    plans = []
    for i, (path, name) in enumerate(models):
        kind = model_kind(path)
        chosen = files[i] if len(files) == len(models) else (files[0] if files else bundled_pipeline(kind))
        pipeline = load_pipeline(chosen) if chosen else default_llm_pipeline(connector)
        plans.append(ModelPlan(path=os.path.abspath(path), name=name, kind=kind, pipeline=pipeline,
                               pipeline_file=chosen))
    return plans


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as handle:
            value = json.load(handle)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
