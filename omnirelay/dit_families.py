"""Diffusion-transformer pipeline families: what a Z-Image or Wan directory takes and makes by default.

One table, read by the gateway (defaults and the 400s for requests the model cannot honour,
before anything reaches a worker) and by the generate worker (the sizes its engine accepts), so
both agree. Nothing here imports torch or diffusers: a family is resolved from the pipeline class
name in ``model_index.json`` and the component configs (plain JSON dicts).

==================  =========================  ==========  ==========  ===========================
pipeline class      size multiple (pixels)     steps       guidance    frames
==================  =========================  ==========  ==========  ===========================
ZImagePipeline      VAE factor × patch (16)    9 (Turbo)   0.0 (off)   —
WanPipeline         VAE factor × patch (16)    50          5.0         4k + 1 (VAE's time factor 4)
==================  =========================  ==========  ==========  ===========================

Defaults are the pipelines' own (``ZImagePipeline``'s Turbo recipe: 9 steps, i.e. 8 transformer
evaluations, without classifier-free guidance; ``WanPipeline.__call__``'s 50 steps at guidance 5,
832×480, 16 fps). Native sizes are the pipelines' defaults too: neither transformer config states one.
A directory may state its own in ``model_index.json`` as ``"_omnirelay_native_size": [width, height]``
(diffusers' loader ignores every key with a leading underscore): the tiny builders do, because a
2-block test transformer at the real model's size spends its whole step in attention over tens of
thousands of tokens (``deploy/builders/wan.py``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from omnirelay.errors import BadRequest
from omnirelay.model_kind import read_json


@dataclasses.dataclass(frozen=True)
class DiTFamily:
    """pipeline_class: diffusers' class name; size_multiple: width and height must divide by it
    (the VAE's pixels per latent times the transformer's patch); native_size: (width, height) when
    the request gives none; default_steps / default_guidance: what an unparameterised request gets;
    frame_step: ``num_frames`` must be ``frame_step·k + 1`` (1: any count); default_fps: video only."""

    pipeline_class: str
    size_multiple: int
    native_size: tuple[int, int]
    default_steps: int
    default_guidance: float
    frame_step: int = 1
    default_fps: int = 0

    def check_size(self, width: int, height: int) -> None:
        """Raise :class:`BadRequest` (param ``size``) for a size the transformer's patching cannot take."""
        if width % self.size_multiple or height % self.size_multiple:
            raise BadRequest(f"{self.pipeline_class} makes sizes in multiples of {self.size_multiple} pixels "
                             f"(VAE factor × patch), got {width}x{height}", param="size")

    def check_frames(self, num_frames: int) -> None:
        if (num_frames - 1) % self.frame_step:
            raise BadRequest(f"{self.pipeline_class} makes {self.frame_step}·k + 1 frames (its VAE packs "
                             f"{self.frame_step} frames per latent), got {num_frames}", param="num_frames")

    def round_frames(self, num_frames: int) -> int:
        """The nearest frame count this family makes (at least 1)."""
        k = max(0, round((num_frames - 1) / self.frame_step))
        return k * self.frame_step + 1


def family_from_configs(pipeline_class: str, transformer: dict[str, Any] | None,
                        vae: dict[str, Any] | None) -> DiTFamily | None:
    """The family of a pipeline from its class name and its transformer's and VAE's configs;
    None for a pipeline that is not in the table."""
    transformer, vae = transformer or {}, vae or {}
    if pipeline_class == "ZImagePipeline":
        levels = len(vae.get("block_out_channels") or (0, 0, 0, 0))
        patch = int((transformer.get("all_patch_size") or [2])[0])
        return DiTFamily(pipeline_class, 2 ** (levels - 1) * patch, (1024, 1024), 9, 0.0)
    if pipeline_class == "WanPipeline":
        spatial = int(vae.get("scale_factor_spatial") or 8)
        temporal = int(vae.get("scale_factor_temporal") or 4)
        patch = int((transformer.get("patch_size") or [1, 2, 2])[-1])
        return DiTFamily(pipeline_class, spatial * patch, (832, 480), 50, 5.0, frame_step=temporal, default_fps=16)
    return None


NATIVE_SIZE_KEY = "_omnirelay_native_size"


def family_of_dir(path: str | os.PathLike) -> DiTFamily | None:
    """The family of a diffusers directory, from its JSON files (its own native size where
    ``model_index.json`` states one); None when not in the table. A stated size the family cannot
    make is a ValueError: the directory is broken, not the request."""
    index = read_json(os.path.join(path, "model_index.json"))
    if index is None:
        return None
    family = family_from_configs(str(index.get("_class_name", "")),
                                 read_json(os.path.join(path, "transformer", "config.json")),
                                 read_json(os.path.join(path, "vae", "config.json")))
    stated = index.get(NATIVE_SIZE_KEY)
    if family is None or stated is None:
        return family
    if not (isinstance(stated, list) and len(stated) == 2 and all(isinstance(v, int) and v > 0 for v in stated)) \
            or any(v % family.size_multiple for v in stated):
        raise ValueError(f"{path}: {NATIVE_SIZE_KEY} must be [width, height] in multiples of "
                         f"{family.size_multiple}, got {stated!r}")
    return dataclasses.replace(family, native_size=(stated[0], stated[1]))


def family_of_pipeline(pipe) -> DiTFamily | None:
    """The family of a loaded pipeline (its components' configs)."""
    transformer = pipe.components.get("transformer")
    vae = pipe.components.get("vae")
    return family_from_configs(type(pipe).__name__, dict(transformer.config) if transformer is not None else None,
                               dict(vae.config) if vae is not None else None)


