"""Which pipeline each served model runs, decided once by the launchers (``omni-serve``, Ray).

A model directory says what it is (:mod:`omnirelay.model_kind`, the one place that decides): a
text-to-image or text-to-video diffusers pipeline, an omni model (encode → prefill → decode →
generate), a Qwen3-Omni one (the same stages: its encoders, MoE thinker, talker + code2wav), a
Qwen3-TTS speech model (one generate stage: text in, audio out), or a causal LM (prefill → decode).
Each kind has a stage-pipeline file bundled in ``deploy/pipelines/``; ``--stage-configs-path`` overrides
it, once for all models or once per model in order.

A causal LM without an explicit file keeps ``pipeline_file=None``: its workers then build the
prefill → decode pipeline themselves around ``--connector``, so that one flag still moves the KV
handoff to another backend.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from omnirelay.model_kind import ModelKind, model_kind
from omnirelay.pipeline import Pipeline, PipelineError, default_llm_pipeline, load_pipeline

BUNDLED = Path(__file__).resolve().parent / "pipelines"
# Bundled pipeline per model kind, best first: a kind may have a richer pipeline that a build lacks.
PIPELINES_BY_KIND = {
    ModelKind.TEXT_TO_IMAGE: ("text_to_image.yaml",),
    ModelKind.TEXT_TO_VIDEO: ("text_to_video.yaml",),
    ModelKind.OMNI: ("omni.yaml", "omni_thinker.yaml"),
    ModelKind.QWEN3_OMNI: ("qwen3_omni.yaml", "qwen3_omni_thinker.yaml"),
    ModelKind.QWEN3_TTS: ("qwen3_tts.yaml",),
}


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """One served model as the launchers start it.

    path:           absolute model directory.
    name:           the id clients send in ``model``.
    kind:           ``llm``, ``omni``, ``qwen3-omni``, ``qwen3-tts``, ``text-to-image`` or ``text-to-video`` (:func:`omnirelay.model_kind.model_kind`).
    pipeline:       its stages, connectors and edges.
    pipeline_file:  the YAML its workers and the gateway load (``None``: the default LM pipeline).
    groups:         role → (tensor, pipeline) parallel size of one worker of that role.
    """

    path: str
    name: str
    kind: ModelKind
    pipeline: Pipeline
    pipeline_file: str | None
    groups: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

    @property
    def roles(self) -> tuple[str, ...]:
        return self.pipeline.roles

    def pipeline_args(self) -> list[str]:
        return ["--stage-configs-path", self.pipeline_file] if self.pipeline_file else []


def bundled_pipeline(kind: ModelKind) -> str | None:
    """The bundled pipeline file for ``kind``; None for a causal LM (its workers build the default)."""
    if kind == ModelKind.LLM:
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
