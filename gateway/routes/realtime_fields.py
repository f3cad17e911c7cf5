"""The fields of ``/v1/realtime``'s ``session.update`` and ``response.create`` that both share, each
checked the one way: a bad value is an error naming its path (``session.audio.output.voice``,
``response.tools``), and a field this server does not serve is refused by name, never accepted and
ignored (:func:`refuse_others`; null counts as absent, as OpenAI's clients send it).
"""

from __future__ import annotations

from typing import Any

from omnirelay.errors import BadRequest, Unprocessable

from ..models import ModelRuntime
from .speech import voices

OUTPUT_RATE = 24000                      # the speech worker's PCM: 16-bit mono at 24 kHz
MIN_SPEED, MAX_SPEED = 0.25, 1.5         # OpenAI's range for audio.output.speed


def object_field(value: Any, param: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"'{param}' must be an object", param=param)
    return value


def refuse_others(raw: dict, served: set[str], where: str) -> None:
    """A field this server does not serve is an error naming it, never ignored (null is absent)."""
    for key in sorted(raw.keys() - served):
        if raw[key] is not None:
            raise Unprocessable(f"{where}.{key} is not supported by this server", param=f"{where}.{key}")


def voice(model: ModelRuntime, voice: Any, param: str) -> str:
    """``voice`` as the model names it (whatever its case); an unknown one is an error naming ``param``."""
    names = voices(model)
    if not isinstance(voice, str) or not voice:
        raise BadRequest(f"'{param}' must be a non-empty string", param=param)
    if names is None or voice in names:
        return voice   # no readable table (a pickled one): the worker checks the name
    folded = [name for name in names if name.casefold() == voice.casefold()]
    if len(folded) != 1:
        raise BadRequest(f"voice {voice!r} is not available for model {model.name!r}"
                         + (f"; choose one of {', '.join(names)}" if names else ""), param=param)
    return folded[0]


def speed(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not MIN_SPEED <= value <= MAX_SPEED:
        raise BadRequest(f"'{param}' must be a number from {MIN_SPEED} to {MAX_SPEED}", param=param)
    return float(value)


def output_format(fmt: Any, param: str) -> None:
    if not (isinstance(fmt, dict) and fmt.get("type") == "audio/pcm" and fmt.get("rate", OUTPUT_RATE) == OUTPUT_RATE):
        raise Unprocessable(f"output audio is audio/pcm at {OUTPUT_RATE} Hz", param=param)


def tools(raw: dict, where: str) -> None:
    """Function calling is not served on this route: tools must be empty and tool_choice a no-op."""
    if raw.get("tools"):
        raise Unprocessable(f"{where}.tools: function calling is not served on /v1/realtime", param=f"{where}.tools")
    if raw.get("tool_choice") not in (None, "auto", "none"):
        raise Unprocessable(f"{where}.tool_choice: function calling is not served on /v1/realtime; "
                            "send 'auto', 'none' or nothing", param=f"{where}.tool_choice")


def metadata(value: Any) -> dict | None:
    """A response's ``metadata`` (echoed on its events): OpenAI's bounds, 16 string pairs."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()):
        raise BadRequest("'response.metadata' must map at most 16 keys (64 characters) to strings (512 characters)",
                         param="response.metadata")
    return value
