"""``--dtype`` reaches the diffusion stage: a generate worker started with ``--dtype bfloat16``
holds bfloat16 denoiser weights (its log line and its heartbeat say so, read from the loaded
module) and still makes images, which differ from float32's by rounding only.
"""

from __future__ import annotations

import base64
import io
import pathlib
import time

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from omnirelay.deploy.diffusion_builder import build_tiny_text_to_image

from cluster import Cluster

MODEL = "tiny-sd"
PIPELINE_YAML = str(pathlib.Path(__file__).resolve().parent.parent / "deploy" / "pipelines" / "text_to_image.yaml")
PROMPT = "a lighthouse on a rocky coast during a storm"


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / MODEL
    build_tiny_text_to_image(path, seed=0)
    return str(path)


@pytest.fixture(scope="module")
def bf16_cluster(tiny_sd, tmp_path_factory):
    cluster = Cluster(model=tiny_sd, log_dir=str(tmp_path_factory.mktemp("bf16-cluster")), model_name=MODEL)
    try:
        cluster.start_broker()
        cluster.worker = cluster.start_worker("generate", "--stage-configs-path", PIPELINE_YAML, "--dtype", "bfloat16")
        cluster.start_gateway("--stage-configs-path", PIPELINE_YAML)
        cluster.wait_healthy()
        yield cluster
    finally:
        cluster.stop()


def test_generate_worker_holds_bfloat16_weights_and_still_makes_images(bf16_cluster, tiny_sd):
    deadline = time.monotonic() + 30
    while "denoiser_weight_bits" not in (stats := bf16_cluster.workers()[0]["stats"]):
        assert time.monotonic() < deadline, "no heartbeat with the worker's stats"
        time.sleep(0.2)
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
    from omnirelay.workers.generate_image import load_pipeline
    torch.set_num_threads(1)
    pipe = load_pipeline(tiny_sd)
    reference = pipe(PROMPT, width=64, height=64, num_inference_steps=3,
                     generator=torch.Generator().manual_seed(4)).images[0]
    reference = np.asarray(reference.convert("RGB"), dtype=np.float64)
    difference = np.abs(pixels - reference)
    assert difference.max() > 0, "a bfloat16 worker should not reproduce float32 bit for bit"
    assert difference.mean() < 0.25 * pixels.std(), "bfloat16 should only round, not change the picture"
