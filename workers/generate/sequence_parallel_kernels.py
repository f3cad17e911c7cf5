"""Which sequence-parallel kernel runs which diffusion transformer, and how one forward's arguments
cross the group (:mod:`.sequence_parallel_group` drives it; this module only translates).

* ``SD3Transformer2DModel`` (:mod:`.sequence_parallel`): latents, prompt, pooled prompt and
  timesteps cross; the image tokens must divide by N.
* ``ZImageTransformer2DModel`` (:mod:`.sequence_parallel_zimage`): one latent per image, the
  timesteps, one caption (of any length) per image; any token count (the kernel pads).
* ``WanTransformer3DModel`` (:mod:`.sequence_parallel_wan`, both experts of Wan 2.2 A14B):
  latents, timesteps, prompt; any token count (the kernel pads).

Rank 0 calls :meth:`SPKernel.pack` with the transformer's ``forward`` arguments as the pipeline
passed them (bound to the signature, so positional and keyword calls read alike): it refuses what
the kernel does not cover — before anything is broadcast, so the group stays in step — and turns
the rest into a flat list of tensors plus a few integers. Every rank then calls
:meth:`SPKernel.run` with that list; rank 0 hands :meth:`SPKernel.wrap`'s result back to the
pipeline in the shape the model's own ``forward`` returns it.

Nothing here decides ranks or talks to a socket; :meth:`SPKernel.check_config` reads only JSON (before
anything loads).
"""

from __future__ import annotations

import torch

from omnirelay.workers.generate.sequence_parallel import sequence_parallel_forward
from omnirelay.workers.generate.sequence_parallel_wan import wan_sequence_parallel_forward
from omnirelay.workers.generate.sequence_parallel_zimage import zimage_sequence_parallel_forward


class SPConfigError(ValueError):
    """A transformer config the kernel cannot run at this size; the message says why."""


def _refuse_extras(arguments: dict, names: tuple[str, ...], what: str) -> None:
    """ValueError if any of ``names`` carries something (not None, not empty)."""
    given = [name for name in names if arguments.get(name) not in (None, {}, [], ())]
    if given:
        raise ValueError(f"the sequence-parallel {what} takes no {', '.join(given)}")


def _output(sample, return_dict: bool):
    if not return_dict:
        return (sample,)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput
    return Transformer2DModelOutput(sample=sample)


class SPKernel:
    """One transformer class's kernel. ``pads``: any token count splits (the kernel pads the
    sequence and masks the padding out of attention); otherwise the count must divide by N."""

    transformer_class = ""
    pads = False

    def check_config(self, config: dict, size: int, model_path: str, vae_config: dict) -> None:
        """Raise :class:`SPConfigError` for a transformer config (JSON) this kernel cannot split."""

    def token_unit(self, model) -> int:
        """Latent pixels per token side (the patch), for the per-request size check."""
        return 1

    def pack(self, model, arguments: dict) -> tuple[list[torch.Tensor], list[int]]:
        raise NotImplementedError

    def run(self, model, tensors: list[torch.Tensor], ints: list[int]):
        raise NotImplementedError

    def wrap(self, out, arguments: dict):
        return _output(out, arguments.get("return_dict", True))


class SD3Kernel(SPKernel):
    transformer_class = "SD3Transformer2DModel"

    def check_config(self, config: dict, size: int, model_path: str, vae_config: dict) -> None:
        if config.get("dual_attention_layers"):
            raise SPConfigError(f"sequence-parallel size {size}: {model_path}'s transformer has dual-attention "
                                "layers (SD3.5), which the sequence-parallel kernel does not cover")
        sample, patch = config.get("sample_size", 128), int(config.get("patch_size", 2))
        rows, cols = (sample, sample) if isinstance(sample, int) else sample
        tokens = (rows // patch) * (cols // patch)
        if tokens % size:
            scale = 2 ** (len(vae_config.get("block_out_channels", [0] * 4)) - 1)
            divisors = [d for d in range(1, tokens + 1) if tokens % d == 0]
            raise SPConfigError(
                f"sequence-parallel size {size} does not divide the {tokens} image tokens "
                f"({rows // patch}×{cols // patch} patches of {patch}×{patch} latents) of {model_path}'s native "
                f"{cols * scale}×{rows * scale} image: each rank takes an equal slice of the tokens; "
                f"use one of {divisors}")

    def token_unit(self, model) -> int:
        return int(model.config.patch_size)

    def pack(self, model, arguments: dict) -> tuple[list[torch.Tensor], list[int]]:
        _refuse_extras(arguments, ("block_controlnet_hidden_states", "joint_attention_kwargs", "skip_layers"),
                       "SD3 transformer")
        hidden_states, timestep = arguments["hidden_states"], arguments["timestep"]
        batch, _, height, width = hidden_states.shape
        patch = self.token_unit(model)
        if (height // patch) * (width // patch) % torch.distributed.get_world_size():
            raise ValueError(f"{height // patch}×{width // patch} image tokens do not split over "
                             f"{torch.distributed.get_world_size()} sequence-parallel ranks")
        timestep = timestep.reshape(-1).expand(batch) if timestep.numel() == 1 else timestep
        return [hidden_states, arguments["encoder_hidden_states"], arguments["pooled_projections"], timestep], []

    def run(self, model, tensors: list[torch.Tensor], ints: list[int]):
        return sequence_parallel_forward(model, *tensors)


class ZImageKernel(SPKernel):
    """Text to image: a list of latents ``(C, 1, H, W)``, their timesteps, a list of captions of
    any lengths (the header carries how many latents; the captions are the rest after ``t``)."""

    transformer_class = "ZImageTransformer2DModel"
    pads = True

    def pack(self, model, arguments: dict) -> tuple[list[torch.Tensor], list[int]]:
        _refuse_extras(arguments, ("controlnet_block_samples", "siglip_feats", "image_noise_mask",
                                   "joint_attention_kwargs"), "Z-Image transformer")
        x, t, captions = arguments["x"], arguments["t"], arguments["cap_feats"]
        if not x or any(not isinstance(item, torch.Tensor) for item in (*x, *captions)):
            raise ValueError("the sequence-parallel Z-Image transformer runs text to image (lists of tensors), "
                             "not the Omni mode's nested lists")
        patch, frame_patch = int(arguments["patch_size"]), int(arguments["f_patch_size"])
        if patch not in model.all_patch_size or frame_patch not in model.all_f_patch_size:
            raise ValueError(f"patch sizes {patch}, {frame_patch}: this transformer has {model.all_patch_size}, "
                             f"{model.all_f_patch_size}")
        t = t.reshape(-1).expand(len(x)) if t.numel() == 1 else t
        return [*x, t, *captions], [len(x), patch, frame_patch]

    def run(self, model, tensors: list[torch.Tensor], ints: list[int]):
        count, patch, frame_patch = ints
        return zimage_sequence_parallel_forward(model, tensors[:count], tensors[count], tensors[count + 1:],
                                                patch, frame_patch)


class WanKernel(SPKernel):
    """Text to video, one timestep per sample (A14B and 2.1: both experts are this class)."""

    transformer_class = "WanTransformer3DModel"
    pads = True

    def pack(self, model, arguments: dict) -> tuple[list[torch.Tensor], list[int]]:
        _refuse_extras(arguments, ("encoder_hidden_states_image", "attention_kwargs"), "Wan transformer")
        hidden_states, timestep = arguments["hidden_states"], arguments["timestep"]
        if timestep.numel() == 1:
            timestep = timestep.reshape(-1).expand(hidden_states.shape[0])
        if timestep.ndim != 1:
            raise ValueError("sequence-parallel Wan takes one timestep per sample (not TI2V's per-token ones)")
        return [hidden_states, timestep, arguments["encoder_hidden_states"]], []

    def run(self, model, tensors: list[torch.Tensor], ints: list[int]):
        return wan_sequence_parallel_forward(model, *tensors)


KERNELS: dict[str, SPKernel] = {kernel.transformer_class: kernel
                                for kernel in (SD3Kernel(), ZImageKernel(), WanKernel())}
