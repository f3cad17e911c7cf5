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
import pathlib

import pytest

from cluster import Cluster, assert_contract, classify, run_load
from omnirelay.deploy.diffusion_builder import build_tiny_text_to_image

MODEL = "tiny-sd"
PIPELINE_YAML = str(pathlib.Path(__file__).resolve().parent.parent / "deploy" / "pipelines" / "text_to_image.yaml")
N_REQUESTS, CONCURRENCY, KILL_AFTER = 24, 4, 6
STEPS = 12               # ~0.1-0.5 s of denoising per image here: the kill lands mid-generation
REQUEST_TIMEOUT_S = 60.0
SUBJECTS = ["a fox", "a boat", "a tree", "a house", "the sea", "a cat", "a bridge", "the moon"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / MODEL
    build_tiny_text_to_image(path, seed=0)
    return str(path)


@pytest.fixture
def cluster(tiny_sd, tmp_path):
    cluster = Cluster(model=tiny_sd, log_dir=str(tmp_path), model_name=MODEL)
    try:
        cluster.start_broker()
        for _ in range(2):
            cluster.start_worker("generate", "--stage-configs-path", PIPELINE_YAML)
        cluster.start_gateway("--stage-configs-path", PIPELINE_YAML)
        cluster.wait_healthy()
        cluster.wait_for_workers(2)
        yield cluster
    finally:
        cluster.stop()


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

    def kill_a_busy_generate_worker() -> None:
        # The one that holds work now (heartbeats lag by up to a second; under this load both do).
        workers = sorted(cluster.workers(), key=lambda w: -(w["running"] + w["waiting"]))
        victim = next(proc for proc in cluster.procs if proc.pid == workers[0]["pid"])
        killed["busy"] = workers[0]["running"] + workers[0]["waiting"]
        victim.kill9()
        killed["proc"] = victim

    results = _load(cluster.url, fault=kill_a_busy_generate_worker)
    counts = classify(results, baseline)
    print(f"\nkill -9 generate: {counts} (victim held {killed.get('busy')} task(s) by its last heartbeat)")
    assert_contract(counts, results)
    assert not killed["proc"].alive()
    # The broker noticed the death itself and started the dead worker's stage again elsewhere.
    logs = cluster.logs()
    assert "missed heartbeats; dropping it" in logs
    retried = cluster.broker_counters().get("stage_retries", 0) - retries_before
    resubmitted = logs.count("resubmitting")
    print(f"kill -9 generate: {retried} stage(s) re-dispatched by the broker, {resubmitted} resubmitted by the gateway")
    assert retried + resubmitted >= 1, "the kill hit no request in flight"
    # The survivor keeps serving.
    assert [w["role"] for w in cluster.workers()] == ["generate"]
    assert _load(cluster.url, n=1) == [("completed", baseline[0])]
