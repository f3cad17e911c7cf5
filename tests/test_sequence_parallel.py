"""Sequence parallelism for a diffusion transformer: two ranks over gloo, each holding half of the
image tokens, produce the same noise prediction as one rank running the whole model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from omnirelay.workers.generate.sequence_parallel import sequence_parallel_forward


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
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = _tiny_transformer()
        latents, text, pooled, timestep = _inputs()
        # Each rank gets the inputs whole and returns the output whole.
        before = {name: type(proc) for name, proc in model.attn_processors.items()}
        out = sequence_parallel_forward(model, latents, text, pooled, timestep)
        assert {name: type(proc) for name, proc in model.attn_processors.items()} == before
        save_file({"out": out.contiguous()}, os.path.join(result_dir, f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sequence_parallel_equals_one_rank(world, tmp_path):
    torch.set_num_threads(1)
    model = _tiny_transformer()
    latents, text, pooled, timestep = _inputs()
    with torch.inference_mode():
        reference = model(latents, text, pooled, timestep, return_dict=False)[0]
    port = _free_port()
    ranks = [subprocess.Popen([sys.executable, __file__, str(rank), str(world), str(port), str(tmp_path)])
             for rank in range(world)]
    try:
        codes = [proc.wait(timeout=240) for proc in ranks]
    finally:
        for proc in ranks:    # only on a timeout: a rank stuck in a collective
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert codes == [0] * world
    outputs = [load_file(tmp_path / f"rank{r}.safetensors")["out"] for r in range(world)]
    for out in outputs:
        assert out.shape == reference.shape == latents.shape
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert reference.std() > 0.1   # a real prediction, not zeros


if __name__ == "__main__":   # one rank, started by the test above
    _rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
