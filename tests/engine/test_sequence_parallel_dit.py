"""Sequence parallelism for the diffusion transformers of Wan (both experts of Wan 2.2 are one
class) and Z-Image: ranks over gloo, each holding its share of the tokens, make the same noise
prediction as one rank running the whole model (the kernels of
:mod:`omnirelay.workers.generate.sequence_parallel_wan` and :mod:`omnirelay.workers.generate.sequence_parallel_zimage`)."""

from __future__ import annotations

import sys

import pytest
import torch

from omnirelay.workers.generate.sequence_parallel_wan import wan_sequence_parallel_forward
from omnirelay.workers.generate.sequence_parallel_zimage import zimage_sequence_parallel_forward

from rank_processes import gloo_group, run_ranks, save_rank_output


def _tiny_wan():
    from omnirelay.deploy.builders.wan import _transformer

    torch.manual_seed(0)
    model = _transformer()
    with torch.no_grad():   # the zero-initialised output table would hide errors in the last layers
        model.scale_shift_table.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(2))
    return model


def _inputs():
    generator = torch.Generator().manual_seed(1)
    # 2 samples, 16 latent channels, 3 latent frames of 4×6: 3·2·3 = 18 tokens after the 2×2 patch
    return (torch.randn(2, 16, 3, 4, 6, generator=generator), torch.tensor([900.0, 120.0]),
            torch.randn(2, 11, 32, generator=generator))


def _tiny_zimage():
    from omnirelay.deploy.builders.zimage import _transformer

    torch.manual_seed(0)
    model = _transformer()
    with torch.no_grad():   # the zero-initialised modulations and output would hide errors in the layers
        generator = torch.Generator().manual_seed(2)
        for name, param in model.named_parameters():
            if "adaLN_modulation" in name or "final_layer" in name:
                param.normal_(0.0, 0.2, generator=generator)
    return model


def _zimage_inputs():
    generator = torch.Generator().manual_seed(1)
    # 2 images of 8×10 latents (20 tokens each); captions of 7 and 40 tokens (padded to 32 and 64
    # inside the model, so the two sequences differ in length and attention needs its key mask)
    latents = [torch.randn(16, 1, 8, 10, generator=generator) for _ in range(2)]
    captions = [torch.randn(n, 64, generator=generator) for n in (7, 40)]
    return latents, torch.tensor([0.9, 0.3]), captions


def _zimage_forward(model, group=None):
    latents, timestep, captions = _zimage_inputs()
    if group is False:
        return torch.stack(model(latents, timestep, captions, return_dict=False)[0])
    return torch.stack(zimage_sequence_parallel_forward(model, latents, timestep, captions))


def _processor_types(model) -> dict[str, type]:
    return {name: type(module.processor) for name, module in model.named_modules() if "processor" in vars(module)}


def _rank(rank: int, world: int, port: int, result_dir: str, which: str) -> None:
    with gloo_group(rank, world, port):
        model = _tiny_wan() if which == "wan" else _tiny_zimage()
        before = _processor_types(model)
        if which == "wan":
            latents, timestep, text = _inputs()
            out = wan_sequence_parallel_forward(model, latents, timestep, text)
        else:
            out = _zimage_forward(model)
        assert _processor_types(model) == before      # the kernel put the model's own processors back
        save_rank_output(out, rank, result_dir)


# ~100 s each on a loaded 2-core box: every rank is a fresh interpreter importing diffusers
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_wan_sequence_parallel_equals_one_rank(world, tmp_path):
    torch.set_num_threads(1)
    model = _tiny_wan()
    latents, timestep, text = _inputs()
    with torch.inference_mode():
        reference = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=text,
                          return_dict=False)[0]
    for out in run_ranks(__file__, world, tmp_path, "wan"):
        assert out.shape == reference.shape == latents.shape
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert reference.std() > 0.1   # a real prediction, not zeros


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])   # 3: 120 tokens pad to 123
def test_zimage_sequence_parallel_equals_one_rank(world, tmp_path):
    torch.set_num_threads(1)
    with torch.inference_mode():
        reference = _zimage_forward(_tiny_zimage(), group=False)
    for out in run_ranks(__file__, world, tmp_path, "zimage"):
        assert out.shape == reference.shape == (2, 16, 1, 8, 10)
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert reference.std() > 0.1


def test_wan_sequence_parallel_refuses_per_token_timesteps():
    latents, timestep, text = _inputs()
    with pytest.raises(ValueError, match="one timestep per sample"):   # TI2V-5B's layout is out of scope
        wan_sequence_parallel_forward(_tiny_wan(), latents, timestep[:, None].expand(2, 18), text)


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
