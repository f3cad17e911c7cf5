"""Which builder assembles a worker: one entry per (role, model kind) a worker can serve.

The model kind is the directory's own (:func:`omnirelay.model_kind.model_kind`); each builder
returns a :class:`~omnirelay.workers.runtime.assembly.BuiltRole` (role adapter, heartbeat stats,
what the runtime closes). A pair missing here is refused before anything loads:
:class:`UnsupportedRole` names the roles that model kind can serve.
"""

from __future__ import annotations

from omnirelay.model_kind import ModelKind

from omnirelay.workers.encode.role import build_encode_role, build_qwen3_omni_encode_role
from omnirelay.workers.generate.image_role import build_generate_role
from omnirelay.workers.generate.video_role import build_generate_video_role
from omnirelay.workers.llm.role_builders import build_decode_role, build_prefill_role
from omnirelay.workers.runtime.assembly import RoleBuilder
from omnirelay.workers.speech.qwen3_tts_role import build_qwen3_tts_role
from omnirelay.workers.speech.role import build_qwen3_omni_speech_role, build_speech_role

ROLE_BUILDERS: dict[tuple[str, ModelKind], RoleBuilder] = {
    # A causal LM: prefill and decode only.
    ("prefill", ModelKind.LLM): build_prefill_role,
    ("decode", ModelKind.LLM): build_decode_role,
    # Qwen2.5-Omni and Qwen3-Omni: media encoders, the thinker (prefill, decode), talker + vocoder.
    ("encode", ModelKind.OMNI): build_encode_role,
    ("prefill", ModelKind.OMNI): build_prefill_role,
    ("decode", ModelKind.OMNI): build_decode_role,
    ("generate", ModelKind.OMNI): build_speech_role,
    ("encode", ModelKind.QWEN3_OMNI): build_qwen3_omni_encode_role,
    ("prefill", ModelKind.QWEN3_OMNI): build_prefill_role,
    ("decode", ModelKind.QWEN3_OMNI): build_decode_role,
    ("generate", ModelKind.QWEN3_OMNI): build_qwen3_omni_speech_role,
    # One generate stage, nothing flowing in from another: text to speech, image, video.
    ("generate", ModelKind.QWEN3_TTS): build_qwen3_tts_role,
    ("generate", ModelKind.TEXT_TO_IMAGE): build_generate_role,
    ("generate", ModelKind.TEXT_TO_VIDEO): build_generate_video_role,
}


class UnsupportedRole(ValueError):
    """A role the model kind has no builder for (``omni-worker`` exits with status 2)."""


def role_builder(role: str, kind: ModelKind) -> RoleBuilder:
    """The builder of a ``role`` worker for a model of ``kind``; :class:`UnsupportedRole` if there is none."""
    builder = ROLE_BUILDERS.get((role, kind))
    if builder is None:
        roles = [r for r, k in ROLE_BUILDERS if k is kind]
        raise UnsupportedRole(f"a model of kind {kind.value!r} has no {role!r} role (its roles: {', '.join(roles)})")
    return builder
