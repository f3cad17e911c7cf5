"""kill -9 of an encode worker (tiny Qwen2.5-Omni thinker) under a bounded load.

Two encode workers, one prefill, one decode, with ``deploy/pipelines/omni_thinker.yaml``. The load
(16 chat requests with an image each, concurrency 4, greedy) runs while the encode worker that is
busy is killed with SIGKILL after 4 answers. Encode is idempotent: the broker puts the dead
worker's stage back in the queue, so every request must complete — or fail with a structured
error. The reference is the same load run again afterwards on the surviving cluster (run before,
it would fill the encoder caches and the killed worker would have had next to nothing to do).
Each request is classified completed / structured error / wrong / hung / unstructured / lost and
the counts are printed; the contract is 0 hung, 0 lost, 0 wrong, 0 unstructured. Mirrors the
prefill/decode scenarios of ``test_faults.py``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os

import numpy as np
import pytest
from PIL import Image

from cluster import assert_contract, classify, run_load
from media_support import kill_busiest_worker, pipeline_cluster, tiny_model_dir
from omnirelay.connectors.shared_memory import sweep_orphans
from omnirelay.deploy.builders.omni import build_tiny_omni
from repo_paths import REPO_ROOT

MODEL = "tiny-omni"
PIPELINE = os.path.join(REPO_ROOT, "deploy", "pipelines", "omni_thinker.yaml")
N_REQUESTS, CONCURRENCY, KILL_AFTER, MAX_TOKENS = 16, 4, 4, 6
REQUEST_TIMEOUT_S = 90.0

pytestmark = pytest.mark.slow


def _image(i: int) -> dict:
    # 224×224: enough patches that encoding takes a while, so the kill finds one in flight.
    pixels = (np.random.RandomState(i).rand(224, 224, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    data_url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": data_url}}


@pytest.fixture(scope="module")
def tiny_omni(tmp_path_factory) -> str:
    return tiny_model_dir(tmp_path_factory, MODEL, build_tiny_omni)


@pytest.fixture
def cluster(tiny_omni, tmp_path):
    killed: set[int] = set()
    try:
        with pipeline_cluster(tiny_omni, str(tmp_path), MODEL, PIPELINE,
                              ("encode", "encode", "prefill", "decode")) as cluster:
            cluster.killed = killed
            yield cluster
    finally:
        # What the worker killed on purpose left in /dev/shm (a connector starting later would sweep
        # it; none does here). Only that PID's: a clean exit must still leave nothing by itself.
        sweep_orphans(owners=killed)


async def _chat(client, i: int) -> list[int]:
    response = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [_image(i), {"type": "text", "text": f"Picture {i}?"}]}],
        temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True, "return_token_ids": True})
    return response.choices[0].model_extra["token_ids"]


def _load(url: str, fault=None) -> list:
    return asyncio.run(run_load(url, _chat, N_REQUESTS, concurrency=CONCURRENCY, timeout_s=REQUEST_TIMEOUT_S,
                                fault=fault, after=KILL_AFTER))



def test_kill9_encode_worker_under_load(cluster):
    killed: dict = {}

    def kill_a_busy_encode_worker() -> None:
        kill_busiest_worker(cluster, killed, role="encode")
        cluster.killed.add(killed["proc"].pid)

    results = _load(cluster.url, fault=kill_a_busy_encode_worker)
    logs = cluster.logs()
    retried = cluster.broker_counters().get("stage_retries", 0)
    reference = [tokens for _, tokens in _load(cluster.url)]
    counts = classify(results, reference)
    print(f"\nkill -9 encode: {counts}; {retried} stage(s) re-dispatched by the broker (victim held "
          f"{killed.get('busy')} task(s))")
    assert all(isinstance(tokens, list) for tokens in reference), reference
    assert_contract(counts, results)
    assert not killed["proc"].alive()
    assert "missed heartbeats; dropping it" in logs   # the broker noticed the death itself
    assert retried >= 1, "the kill hit no encode stage in flight"
    assert [w["role"] for w in cluster.workers()].count("encode") == 1   # the survivor serves on
