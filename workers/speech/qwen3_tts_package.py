"""Import Qwen3-TTS's model code from the ``qwen_tts`` package, and nothing that cannot load here.

Which package: ``qwen-tts-compat`` (0.1.1.post1, import name ``qwen_tts``), installed with
``pip install --no-deps qwen-tts-compat==0.1.1.post1``. It is the official ``qwen-tts`` 0.1.1 code
with the changes transformers 5.x needs. The official 0.1.1 cannot be used with transformers 5:
it pins ``transformers==4.57.3``, and under 5.x its 12 Hz tokenizer module fails at import
(``@check_model_inputs()`` is now a plain decorator: "missing 1 required positional argument:
'func'"), its rotary embeddings look up ``ROPE_INIT_FUNCTIONS["default"]`` (gone in 5.x) and it
calls ``create_causal_mask(input_embeds=…, cache_position=…)`` (renamed / dropped). Both packages
are installed without their dependencies: they ask for ``torchaudio`` (which does not load beside
a CPU build of torch from another index) and the official one for transformers 4.x.

The placeholder modules: the package imports its 25 Hz speech tokenizer (V1) whenever the TTS
model class is imported (``modeling_qwen3_tts`` → ``inference.qwen3_tts_tokenizer`` → V1), and that
module imports ``torchaudio.compliance.kaldi``, ``sox``, ``onnxruntime`` and ``einops`` at module
level. A 12 Hz model (``Qwen3-TTS-12Hz-*``, the one served) never runs that code. So while — and only
while — the package is imported, each of those modules that is not installed is stood in for by a
placeholder whose functions raise ImportError naming the 25 Hz tokenizer; the placeholders are
removed from ``sys.modules`` right after, so no other import sees them. A 25 Hz model is refused by
:func:`check_supported` before any of its code would run.

What of the package does not run under transformers 5.25, and what we do instead (in our code;
site-packages is never patched):

* ``Qwen3TTSTokenizerV2Model`` (the whole 12 Hz codec) cannot be built: its encoder subclasses
  transformers' ``MimiModel`` and assigns ``self.upsample = None``, which is a read-only property in
  5.25. Serving needs only the codec's decoder, so the worker builds the package's
  ``Qwen3TTSTokenizerV2Decoder`` from ``speech_tokenizer/config.json``'s ``decoder_config`` and loads
  the checkpoint's ``decoder.*`` tensors into it; decoding follows ``Qwen3TTSTokenizerV2Model.decode``.
  The package's ``Qwen3TTSForConditionalGeneration.from_pretrained`` / ``Qwen3TTSModel.from_pretrained``
  load that whole codec, so the TTS model is built from its config and loaded from safetensors the
  same way (which also avoids the 5.x loader dropping biases, the reason the compat fork re-merges them).
* ``save_pretrained`` fails on the package's 4.x-style ``_tied_weights_keys`` lists (the builder
  writes config + safetensors itself).
* ``Qwen3TTSTalkerCodePredictorConfig`` has no ``pad_token_id`` under 5.x unless the config file
  names one (``pad_token_id_of`` in the fork covers the talker, not the predictor): set to None.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Iterator

PACKAGE_HINT = "pip install --no-deps qwen-tts-compat==0.1.1.post1"
# Imported at module level by the 25 Hz tokenizer only (qwen_tts/core/tokenizer_25hz/vq/*.py).
ONLY_25HZ_MODULES = ("sox", "onnxruntime", "einops", "torchaudio", "torchaudio.compliance",
                     "torchaudio.compliance.kaldi")
SUPPORTED_TOKENIZER = "qwen3_tts_tokenizer_12hz"

_lock = threading.Lock()
_classes: "Qwen3TTSClasses | None" = None


class Qwen3TTSUnavailable(RuntimeError):
    """The ``qwen_tts`` package is missing or cannot be imported here."""


@dataclass(frozen=True)
class Qwen3TTSClasses:
    config: Any              # qwen_tts Qwen3TTSConfig
    model: Any               # qwen_tts Qwen3TTSForConditionalGeneration
    tokenizer_config: Any    # Qwen3TTSTokenizerV2Config (12 Hz)
    codec_decoder: Any       # Qwen3TTSTokenizerV2Decoder (12 Hz codes → 24 kHz waveform)


class _Placeholder(types.ModuleType):
    """A module that is not installed, standing in while the package imports: any function taken
    from it raises ImportError naming the 25 Hz tokenizer (the only code that would call it)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__path__: list[str] = []   # a package, so its submodules can be imported from it

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        name = self.__name__

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise ImportError(f"{name}.{attr} is not installed: only Qwen3-TTS's 25 Hz speech tokenizer uses it, "
                              "and this server serves 12 Hz models only")
        return unavailable


@contextlib.contextmanager
def _only_25hz_placeholders() -> Iterator[None]:
    # What the package imports from elsewhere is imported first, outside the window: some of it
    # (transformers' availability checks, torch._dynamo's trace rules) calls find_spec on these names,
    # which a placeholder would break.
    import librosa.filters  # noqa: F401
    import torch._dynamo  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    from transformers import (AutoConfig, AutoFeatureExtractor, AutoModel, AutoProcessor,  # noqa: F401
                              MimiConfig, MimiModel)
    from transformers.utils.import_utils import is_torchaudio_available
    is_torchaudio_available()
    added: list[str] = []
    for name in ONLY_25HZ_MODULES:
        top = name.split(".")[0]
        if name in sys.modules or (top not in added and importlib.util.find_spec(top) is not None):
            continue
        sys.modules[name] = _Placeholder(name)
        added.append(name)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[name])
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def load_classes() -> Qwen3TTSClasses:
    """The package's config and model classes (imported once per process)."""
    global _classes
    with _lock:
        if _classes is not None:
            return _classes
        import transformers  # noqa: F401  (its lazy module set up before the placeholders)
        if importlib.util.find_spec("qwen_tts") is None:
            raise Qwen3TTSUnavailable(f"Qwen3-TTS needs the qwen_tts package: {PACKAGE_HINT}")
        try:
            with _only_25hz_placeholders():
                from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration
                from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
                    Qwen3TTSTokenizerV2Config)
                from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
                    Qwen3TTSTokenizerV2Decoder)
        except Exception as exc:   # e.g. the official 0.1.1 under transformers 5 (see the module docstring)
            raise Qwen3TTSUnavailable(f"the installed qwen_tts package does not load with this transformers "
                                      f"({type(exc).__name__}: {exc}); {PACKAGE_HINT}") from exc
        _classes = Qwen3TTSClasses(Qwen3TTSConfig, Qwen3TTSForConditionalGeneration, Qwen3TTSTokenizerV2Config,
                                   Qwen3TTSTokenizerV2Decoder)
        return _classes


def available() -> str | None:
    """None when the package loads; else why not (for skips and error messages)."""
    try:
        load_classes()
    except Qwen3TTSUnavailable as exc:
        return str(exc)
    return None


def check_supported(config: dict) -> None:
    """Refuse what this server cannot run, from a model's ``config.json`` (ValueError)."""
    if config.get("tokenizer_type") != SUPPORTED_TOKENIZER:
        raise ValueError(f"Qwen3-TTS tokenizer_type {config.get('tokenizer_type')!r} is not served; only "
                         f"{SUPPORTED_TOKENIZER} (the Qwen3-TTS-12Hz models)")
    if config.get("tts_model_type") != "custom_voice":
        raise ValueError(f"Qwen3-TTS tts_model_type {config.get('tts_model_type')!r} is not served; only "
                         "custom_voice (named speakers; voice cloning and voice design are not)")
