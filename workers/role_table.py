"""Which builder assembles a worker: one entry per (model kind, role) a worker can serve.

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
