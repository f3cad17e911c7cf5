"""Sequence parallelism for a diffusion transformer: two ranks over gloo, each holding half of the
image tokens, produce the same noise prediction as one rank running the whole model."""

from __future__ import annotations

import sys

import pytest
import torch

from omnirelay.workers.generate.sequence_parallel import sequence_parallel_forward

from rank_processes import gloo_group, run_ranks, save_rank_output


def _tiny_transformer():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=3,
                                 attention_head_dim=8, num_attention_heads=4, joint_attention_dim=32,
                                 caption_projection_dim=32, pooled_projection_dim=16, pos_embed_max_size=32,
                                 qk_norm="rms_norm").eval()


def _inputs():
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(2, 4, 16, 16, generator=generator), torch.randn(2, 7, 32, generator=generator),
            torch.randn(2, 16, generator=generator), torch.tensor([500.0, 20.0]))


def _rank(rank: int, world: int, port: int, result_dir: str) -> None:
    with gloo_group(rank, world, port):
        model = _tiny_transformer()
        latents, text, pooled, timestep = _inputs()
        # Each rank gets the inputs whole and returns the output whole.
        before = {name: type(proc) for name, proc in model.attn_processors.items()}
        out = sequence_parallel_forward(model, latents, text, pooled, timestep)
        assert {name: type(proc) for name, proc in model.attn_processors.items()} == before
        save_rank_output(out, rank, result_dir)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sequence_parallel_equals_one_rank(world, tmp_path):
    torch.set_num_threads(1)
    model = _tiny_transformer()
    latents, text, pooled, timestep = _inputs()
    with torch.inference_mode():
        reference = model(latents, text, pooled, timestep, return_dict=False)[0]
    for out in run_ranks(__file__, world, tmp_path):
        assert out.shape == reference.shape == latents.shape
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert reference.std() > 0.1   # a real prediction, not zeros


if __name__ == "__main__":   # one rank, started by the test above
    _rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
