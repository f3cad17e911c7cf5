"""kill -9 of a generate worker (tiny diffusers pipeline) under a bounded load.

Two generate workers serve ``POST /v1/images/generations``. The load (24 requests, concurrency 4,
one image each with a fixed seed) runs once without a fault for the reference images, then again
while the generate worker that is busy is killed with SIGKILL after 6 answers. Generate is
idempotent: the broker puts the dead worker's stage back in the queue (or the gateway resubmits,
same seed), so every request must complete with the very image of the fault-free run — or fail
with a structured error. Each request is classified completed / structured error / wrong image /
hung (no answer within its limit) / unstructured / lost, and the counts are printed; the contract
is 0 hung, 0 lost, 0 wrong, 0 unstructured. Mirrors the prefill/decode scenarios of
``test_faults.py``.
"""

from __future__ import annotations

import asyncio

import pytest

from cluster import assert_contract, classify, run_load
from media_support import assert_the_kill_was_recovered, kill_busiest_worker, pipeline_cluster, tiny_model_dir
from omnirelay.deploy.builders.stable_diffusion import build_tiny_text_to_image
from repo_paths import REPO_ROOT

MODEL = "tiny-sd"
PIPELINE_YAML = str(REPO_ROOT / "deploy" / "pipelines" / "text_to_image.yaml")
N_REQUESTS, CONCURRENCY, KILL_AFTER = 24, 4, 6
STEPS = 12               # ~0.1-0.5 s of denoising per image here: the kill lands mid-generation
REQUEST_TIMEOUT_S = 60.0
SUBJECTS = ["a fox", "a boat", "a tree", "a house", "the sea", "a cat", "a bridge", "the moon"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory) -> str:
    return tiny_model_dir(tmp_path_factory, MODEL, build_tiny_text_to_image)


@pytest.fixture
def cluster(tiny_sd, tmp_path):
    with pipeline_cluster(tiny_sd, str(tmp_path), MODEL, PIPELINE_YAML, ("generate", "generate")) as cluster:
        yield cluster


async def _image(client, i: int) -> str:
    response = await client.images.generate(
        model=MODEL, prompt=f"{SUBJECTS[i % len(SUBJECTS)]}, picture {i}", size="64x64",
        extra_body={"seed": 1000 + i, "num_inference_steps": STEPS})
    return response.data[0].b64_json


def _load(url: str, fault=None, n: int = N_REQUESTS) -> list:
    """Run the requests; call ``fault()`` (in a thread) once ``KILL_AFTER`` of them have answered."""
    return asyncio.run(run_load(url, _image, n, concurrency=CONCURRENCY, timeout_s=REQUEST_TIMEOUT_S, fault=fault,
                                after=KILL_AFTER))


def test_kill9_generate_worker_under_load(cluster):
    baseline = [image for _, image in _load(cluster.url)]
    assert all(isinstance(image, str) and image for image in baseline)
    retries_before = cluster.broker_counters().get("stage_retries", 0)
    killed: dict = {}

    results = _load(cluster.url, fault=lambda: kill_busiest_worker(cluster, killed))
    counts = classify(results, baseline)
    print(f"\nkill -9 generate: {counts} (victim held {killed.get('busy')} task(s))")
    assert_contract(counts, results)
    assert_the_kill_was_recovered(cluster, killed, retries_before, "generate")
    # The survivor keeps serving.
    assert [w["role"] for w in cluster.workers()] == ["generate"]
    assert _load(cluster.url, n=1) == [("completed", baseline[0])]
