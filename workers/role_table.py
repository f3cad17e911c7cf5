"""Which builder assembles a worker: one entry per (model kind, role) a worker can serve.

The model kind is the directory's own (:func:`omnirelay.model_kind.model_kind`); each builder
returns a :class:`~omnirelay.workers.runtime.assembly.BuiltRole` (role adapter, heartbeat stats,
what the runtime closes). A pair missing here is refused before anything loads:
:class:`UnsupportedRole` names the roles that model kind can serve.

The engine a role chooses also checks the worker's config against the model directory's metadata
(:func:`check_config`: a sequence-parallel size the diffusion transformer cannot split, experts that
do not divide over the tensor-parallel ranks), reading no weights; ``omni-worker`` calls it right
after the builder lookup, so a bad flag exits with status 2 before anything loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from omnirelay.model_kind import ModelKind

from omnirelay.workers.encode.role import build_encode_role, build_qwen3_omni_encode_role
from omnirelay.workers.generate.image_role import build_generate_role
from omnirelay.workers.generate.sequence_parallel_group import check_sequence_parallel
from omnirelay.workers.generate.video_role import build_generate_video_role
from omnirelay.workers.llm import quantization as quantized_weights
from omnirelay.workers.llm.expert_parallel import check_expert_parallel
from omnirelay.workers.llm.models.llama import LlamaConfig
from omnirelay.workers.llm.role_builders import build_decode_role, build_prefill_role
from omnirelay.workers.runtime.assembly import RoleBuilder
from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.speech.qwen3_tts_role import build_qwen3_tts_role
from omnirelay.workers.speech.role import build_qwen3_omni_speech_role, build_speech_role

# Per model kind, the builder of each role a worker of that kind can take.
ROLE_BUILDERS: dict[ModelKind, dict[str, RoleBuilder]] = {
    ModelKind.LLM: {"prefill": build_prefill_role, "decode": build_decode_role},
    # Media encoders, the thinker (prefill, decode), talker + vocoder.
    ModelKind.OMNI: {"encode": build_encode_role, "prefill": build_prefill_role, "decode": build_decode_role,
                     "generate": build_speech_role},
    ModelKind.QWEN3_OMNI: {"encode": build_qwen3_omni_encode_role, "prefill": build_prefill_role,
                           "decode": build_decode_role, "generate": build_qwen3_omni_speech_role},
    # One generate stage, nothing flowing in from another: text to speech, image, video.
    ModelKind.QWEN3_TTS: {"generate": build_qwen3_tts_role},
    ModelKind.TEXT_TO_IMAGE: {"generate": build_generate_role},
    ModelKind.TEXT_TO_VIDEO: {"generate": build_generate_video_role},
}


class UnsupportedRole(ValueError):
    """A role the model kind has no builder for (``omni-worker`` exits with status 2)."""


def role_builder(role: str, kind: ModelKind) -> RoleBuilder:
    """The builder of a ``role`` worker for a model of ``kind``; :class:`UnsupportedRole` if there is none."""
    builders = ROLE_BUILDERS[kind]
    if role not in builders:
        raise UnsupportedRole(f"a model of kind {kind.value!r} has no {role!r} role "
                              f"(its roles: {', '.join(builders)})")
    return builders[role]


def _check_language_model(config: WorkerConfig) -> None:
    # Reading the model's config.json refuses what the engine cannot serve (a quantized checkpoint,
    # an architecture or rope scaling it lacks) before any weight loads.
    model = LlamaConfig.from_dir(Path(config.model_path))
    # --quantization against what the checkpoint stores (int8 on a checkpoint already quantized, ...)
    quantized_weights.resolve(config.model_path, model.weight_quant, config.quantization, torch.device("cpu"))
    if config.expert_parallel:   # the model's config.json alone says how many experts it has
        check_expert_parallel(model.moe, config.tensor_parallel_size)


def _check_generate(config: WorkerConfig) -> None:
    # model_index.json and the denoisers' config.json say whether the transformer splits (size 1: no check)
    check_sequence_parallel(config.model_path, config.sequence_parallel_size)


# Per role, its engine's check of a worker's config (the sizes the config alone cannot judge).
CONFIG_CHECKS: dict[str, Callable[[WorkerConfig], None]] = {
    "prefill": _check_language_model, "decode": _check_language_model, "generate": _check_generate}


def check_config(config: WorkerConfig) -> None:
    """Raise ``ValueError`` naming the flag when this role's engine cannot run ``config`` on its model
    (:class:`~omnirelay.workers.generate.sequence_parallel_group.SequenceParallelError`,
    :class:`~omnirelay.workers.llm.expert_parallel.ExpertPlacementError`); reads metadata only."""
    check = CONFIG_CHECKS.get(config.role)
    if check is not None:
        check(config)
