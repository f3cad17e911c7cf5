"""``--dtype`` reaches the diffusion stage: a generate worker started with ``--dtype bfloat16``
holds bfloat16 denoiser weights (its log line and its heartbeat say so, read from the loaded
module) and still makes images, which differ from float32's by rounding only.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from omnirelay.deploy.builders.stable_diffusion import build_tiny_text_to_image

from cluster import Cluster, settled_workers
from media_fixtures import pipeline_file, tiny_model_fixture
from media_support import tiny_model_dir

MODEL = "tiny-sd"
PIPELINE_YAML = pipeline_file("text_to_image")
PROMPT = "a lighthouse on a rocky coast during a storm"


tiny_sd = tiny_model_fixture(MODEL, build_tiny_text_to_image)


@pytest.fixture(scope="module")
def bf16_cluster(tiny_sd, tmp_path_factory):
    with Cluster(model=tiny_sd, log_dir=str(tmp_path_factory.mktemp("bf16-cluster")), model_name=MODEL) as cluster:
        cluster.start_broker()
        cluster.worker = cluster.start_worker("generate", "--stage-configs-path", PIPELINE_YAML, "--dtype", "bfloat16")
        cluster.start_gateway("--stage-configs-path", PIPELINE_YAML)
        cluster.wait_healthy()
        yield cluster


def test_generate_worker_holds_bfloat16_weights_and_still_makes_images(bf16_cluster, tiny_sd):
    stats = settled_workers(bf16_cluster.url)[0]["stats"]   # settled: a heartbeat with its stats is in
    assert stats["denoiser_weight_bits"] == 16
    assert "denoiser weights torch.bfloat16" in bf16_cluster.worker.output()

    client = openai.OpenAI(base_url=bf16_cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    response = client.images.generate(model=MODEL, prompt=PROMPT, size="64x64",
                                      extra_body={"seed": 4, "num_inference_steps": 3})
    image = Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json)))
    assert image.format == "PNG" and image.size == (64, 64)
    pixels = np.asarray(image.convert("RGB"), dtype=np.float64)
    assert pixels.std() > 20

    # The same request in float32, in this process: close (same weights, same seed) but not the
    # same bytes — the worker really computed in bfloat16.
    from omnirelay.workers.generate.image import load_pipeline
    torch.set_num_threads(1)
    pipe = load_pipeline(tiny_sd)
    reference = pipe(PROMPT, width=64, height=64, num_inference_steps=3,
                     generator=torch.Generator().manual_seed(4)).images[0]
    reference = np.asarray(reference.convert("RGB"), dtype=np.float64)
    difference = np.abs(pixels - reference)
    assert difference.max() > 0, "a bfloat16 worker should not reproduce float32 bit for bit"
    assert difference.mean() < 0.25 * pixels.std(), "bfloat16 should only round, not change the picture"


# ----------------------------------------------------------------------------- SD3 (tiny-dit)

DIT_MODEL = "tiny-dit"


@pytest.fixture(scope="module")
def tiny_dit(tmp_path_factory) -> str:
    from omnirelay.deploy.builders.dit import build_tiny_dit
    return tiny_model_dir(tmp_path_factory, DIT_MODEL, build_tiny_dit)


def _float_dtypes(module: torch.nn.Module) -> set[torch.dtype]:
    return {t.dtype for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()}


def test_sd3_pipeline_loads_every_component_in_bfloat16_and_runs(tiny_dit):
    # The transformer used to stay float32 (diffusers' plain loader assigns the file's tensors when
    # the state dict's first entry, SD3's float32 position table, already matches them) while the
    # VAE and text encoders became bfloat16, and the first denoising forward failed.
    from omnirelay.workers.generate.image import load_pipeline
    torch.set_num_threads(1)
    pipe = load_pipeline(tiny_dit, torch.bfloat16)
    modules = {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    assert {"transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"} <= set(modules)
    assert {name: _float_dtypes(m) for name, m in modules.items()} == {name: {torch.bfloat16} for name in modules}
    image = pipe(PROMPT, width=64, height=64, num_inference_steps=2,
                 generator=torch.Generator().manual_seed(3)).images[0]
    assert image.size == (64, 64) and np.asarray(image.convert("RGB"), dtype=np.float64).std() > 10
    # float32 stays float32 throughout.
    pipe = load_pipeline(tiny_dit)
    assert all(_float_dtypes(c) == {torch.float32} for c in pipe.components.values() if isinstance(c, torch.nn.Module))


def test_two_rank_sd3_worker_runs_in_bfloat16(tiny_dit, tmp_path):
    # Rank 0 announces its transformer's dtype; rank 1 casts to it, so the group computes in bf16.
    yaml_path = tmp_path / "text_to_image_sp2.yaml"
    yaml_path.write_text("stages:\n- {name: generate, role: generate, runtime: {max_batch_size: 1}, "
                         "engine_args: {sequence_parallel_size: 2}}\n")
    with Cluster(model=tiny_dit, log_dir=str(tmp_path), model_name=DIT_MODEL) as cluster:
        cluster.start_broker()
        worker = cluster.start_worker("generate", "--stage-configs-path", str(yaml_path), "--dtype", "bfloat16")
        cluster.start_gateway("--stage-configs-path", str(yaml_path))
        cluster.wait_healthy()
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        response = client.images.generate(model=DIT_MODEL, prompt=PROMPT, size="64x64",
                                          extra_body={"seed": 4, "num_inference_steps": 2, "guidance_scale": 5.0})
        image = Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json)))
        assert image.format == "PNG" and image.size == (64, 64)
        stats = cluster.workers()[0]["stats"]
        assert stats["sequence_parallel_size"] == 2 and stats["denoiser_weight_bits"] == 16
        assert "denoiser weights torch.bfloat16" in worker.output()
        assert worker.stop() == 0
    assert "Traceback" not in worker.output(), worker.output()[-3000:]
