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
import time

import openai
import pytest
import requests

from cluster import Cluster
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
        deadline = time.monotonic() + 60
        while len(cluster.workers()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        yield cluster
    finally:
        cluster.stop()


async def _one(client, i: int) -> tuple[str, str]:
    try:
        response = await asyncio.wait_for(client.images.generate(
            model=MODEL, prompt=f"{SUBJECTS[i % len(SUBJECTS)]}, picture {i}", size="64x64",
            extra_body={"seed": 1000 + i, "num_inference_steps": STEPS}), REQUEST_TIMEOUT_S)
        return "completed", response.data[0].b64_json
    except asyncio.TimeoutError:
        return "hung", "no answer in time"
    except openai.APIStatusError as exc:
        body = exc.response.json() if exc.response.headers.get("content-type", "").startswith("application/json") \
            else {}
        structured = isinstance(body.get("error"), dict) and "request_id" in body and "stage" in body
        return ("error" if structured else "unstructured"), f"{exc.status_code} {body or exc.response.text[:200]}"


async def _load(url: str, fault=None) -> list[tuple[str, str] | None]:
    """Run the requests; call ``fault()`` (in a thread) once ``KILL_AFTER`` of them have answered."""
    results: list = [None] * N_REQUESTS
    done = 0
    fired = asyncio.Event()
    semaphore = asyncio.Semaphore(CONCURRENCY)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                  timeout=REQUEST_TIMEOUT_S + 5) as client:
        async def worker(i: int) -> None:
            nonlocal done
            async with semaphore:
                results[i] = await _one(client, i)
            done += 1
            if fault is not None and done >= KILL_AFTER and not fired.is_set():
                fired.set()
                await asyncio.to_thread(fault)

        await asyncio.gather(*(worker(i) for i in range(N_REQUESTS)))
    return results


def _classify(results, baseline) -> dict[str, int]:
    counts = {"completed": 0, "error": 0, "wrong": 0, "hung": 0, "unstructured": 0, "lost": 0}
    for result, expected in zip(results, baseline):
        if result is None:
            counts["lost"] += 1
        elif result[0] == "completed":
            counts["completed" if result[1] == expected else "wrong"] += 1
        else:
            counts[result[0]] += 1
    return counts


def test_kill9_generate_worker_under_load(cluster):
    baseline = [image for _, image in asyncio.run(_load(cluster.url))]
    assert all(isinstance(image, str) and image for image in baseline)
    retries_before = _broker_counters(cluster).get("stage_retries", 0)
    killed: dict = {}

    def kill_a_busy_generate_worker() -> None:
        # The one that holds work now (heartbeats lag by up to a second; under this load both do).
        workers = sorted(cluster.workers(), key=lambda w: -(w["running"] + w["waiting"]))
        victim = next(proc for proc in cluster.procs if proc.pid == workers[0]["pid"])
        killed["busy"] = workers[0]["running"] + workers[0]["waiting"]
        victim.kill9()
        killed["proc"] = victim

    results = asyncio.run(_load(cluster.url, fault=kill_a_busy_generate_worker))
    counts = _classify(results, baseline)
    print(f"\nkill -9 generate: {counts} (victim held {killed.get('busy')} task(s) by its last heartbeat)")
    assert counts["hung"] == 0 and counts["lost"] == 0 and counts["unstructured"] == 0, (counts, results)
    assert counts["wrong"] == 0, counts
    assert counts["completed"] + counts["error"] == N_REQUESTS
    assert not killed["proc"].alive()
    # The broker noticed the death itself and started the dead worker's stage again elsewhere.
    logs = "".join(proc.output() for proc in cluster.procs)
    assert "missed heartbeats; dropping it" in logs
    retried = _broker_counters(cluster).get("stage_retries", 0) - retries_before
    resubmitted = logs.count("resubmitting")
    print(f"kill -9 generate: {retried} stage(s) re-dispatched by the broker, {resubmitted} resubmitted by the gateway")
    assert retried + resubmitted >= 1, "the kill hit no request in flight"
    # The survivor keeps serving.
    assert [w["role"] for w in cluster.workers()] == ["generate"]
    assert asyncio.run(_load_one(cluster.url, 0)) == ("completed", baseline[0])


async def _load_one(url: str, i: int) -> tuple[str, str]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        return await _one(client, i)


def _broker_counters(cluster: Cluster) -> dict:
    return requests.get(cluster.url + "/cluster", timeout=10).json()["broker"]
