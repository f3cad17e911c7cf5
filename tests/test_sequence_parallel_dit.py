"""Sequence parallelism for the Wan video transformer (both experts of Wan 2.2 are this class):
two ranks over gloo, each holding half of the video tokens, make the same noise prediction as one
rank running the whole model (the kernel of :mod:`omnirelay.workers.sequence_parallel_wan`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from omnirelay.workers.sequence_parallel_wan import wan_sequence_parallel_forward


def _tiny_wan():
    from omnirelay.deploy.wan_builder import _transformer

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


def _rank(rank: int, world: int, port: int, result_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = _tiny_wan()
        latents, timestep, text = _inputs()
        before = {name: type(proc) for name, proc in model.attn_processors.items()}
        out = wan_sequence_parallel_forward(model, latents, timestep, text)
        assert {name: type(proc) for name, proc in model.attn_processors.items()} == before
        save_file({"out": out.contiguous()}, os.path.join(result_dir, f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_wan_sequence_parallel_equals_one_rank(world, tmp_path):
    torch.set_num_threads(1)
    model = _tiny_wan()
    latents, timestep, text = _inputs()
    with torch.inference_mode():
        reference = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=text,
                          return_dict=False)[0]
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
    for r in range(world):
        out = load_file(tmp_path / f"rank{r}.safetensors")["out"]
        assert out.shape == reference.shape == latents.shape
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert reference.std() > 0.1   # a real prediction, not zeros


def test_wan_sequence_parallel_refuses_per_token_timesteps():
    latents, timestep, text = _inputs()
    with pytest.raises(ValueError, match="one timestep per sample"):   # TI2V-5B's layout is out of scope
        wan_sequence_parallel_forward(_tiny_wan(), latents, timestep[:, None].expand(2, 18), text)


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
