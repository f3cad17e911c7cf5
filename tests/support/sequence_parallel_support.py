"""A generate worker over sequence-parallel ranks behind the real broker and gateway (not a test
module): its stage YAML, the fleet started and waited on, the "serve on one rank, then on two"
set-up, the worker's heartbeated group statistics, its rank processes from ``/proc``, and the PNG
an image request returns as pixels. Shared by tests/e2e/test_generate_sp.py and
tests/e2e/test_generate_sp_dits.py.
"""

from __future__ import annotations

import base64
import io
import pathlib
import subprocess
import time
from typing import Callable, TypeVar

import numpy as np
import openai
import yaml
from PIL import Image

from cluster import Cluster, Proc, settled_workers

T = TypeVar("T")


def sp_yaml(directory: pathlib.Path, size: int) -> str:
    """A one-stage generate pipeline whose worker runs ``size`` sequence-parallel ranks."""
    path = directory / f"generate_sp{size}.yaml"
    path.write_text(yaml.safe_dump({"stages": [{"name": "generate", "role": "generate",
                                                "runtime": {"max_batch_size": 1},
                                                "engine_args": {"sequence_parallel_size": size}}]}))
    return str(path)


def only_worker(cluster: Cluster, sp_size: int, timeout: float = 60.0) -> dict:
    """The one registered worker, once it has heartbeated that it runs ``sp_size`` ranks: read from
    the settled cluster (:func:`settled_workers`), asked again while a (re)starting worker has yet
    to register — registration is the broker's own state, not a heartbeat's."""
    deadline = time.monotonic() + timeout
    while True:
        workers = settled_workers(cluster.url, timeout=max(1.0, deadline - time.monotonic()))
        if len(workers) == 1 and workers[0]["stats"].get("sequence_parallel_size") == sp_size:
            return workers[0]
        assert time.monotonic() < deadline, f"expected one generate worker of {sp_size} rank(s), got {workers}"
        time.sleep(0.2)


def group_stats(cluster: Cluster) -> dict:
    """The two-rank worker's heartbeated stats once every answered request is counted in them (the
    settled cluster)."""
    return only_worker(cluster, 2)["stats"]


def start_fleet(cluster: Cluster, worker_yaml: str, gateway_yaml: str, sp_size: int) -> tuple[Proc, openai.OpenAI]:
    """Broker, one generate worker on ``worker_yaml`` and the gateway on ``gateway_yaml``; returns the
    worker and an ``openai`` client once the worker has heartbeated its ``sp_size`` ranks."""
    cluster.start_broker()
    worker = cluster.start_worker("generate", "--stage-configs-path", worker_yaml)
    # No supervisor restarts a worker that leaves here: a request waits 5 s for one (what the tests
    # that lose a rank time), not the default's restart-sized --worker-wait.
    cluster.start_gateway("--stage-configs-path", gateway_yaml, "--worker-wait", "5")
    cluster.wait_healthy()
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    only_worker(cluster, sp_size)
    return worker, client


def serve_one_rank_then_two(cluster: Cluster, pipeline: str, directory: pathlib.Path,
                            make: Callable[[openai.OpenAI], T]) -> tuple[openai.OpenAI, Proc, T]:
    """Serve ``pipeline`` from a single-rank worker and run ``make(client)`` on it (the reference);
    then stop that worker (SIGTERM: it drains and unregisters, so the next requests go to its
    successor) and start a two-rank worker in its place. Returns (the client, the two-rank worker
    once it heartbeats, the reference)."""
    single, client = start_fleet(cluster, pipeline, pipeline, 1)
    reference = make(client)
    single.stop()
    split = cluster.start_worker("generate", "--stage-configs-path", sp_yaml(directory, 2))
    cluster.wait_healthy()
    only_worker(cluster, 2)
    return client, split, reference


def generate_png(client: openai.OpenAI, model: str, prompt: str, size: str, extra_body: dict) -> np.ndarray:
    """One image through ``/v1/images/generations``: checked to be a PNG of ``size``, as RGB int16."""
    response = client.images.generate(model=model, prompt=prompt, size=size, extra_body=extra_body)
    [item] = response.data
    image = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
    assert image.format == "PNG" and "x".join(map(str, image.size)) == size
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def assert_same_images(images: list[np.ndarray], reference: list[np.ndarray], labels: list) -> None:
    """Each image equals its reference but for one level of 255 on under 1 % of its pixels (see
    tests/e2e/test_generate_sp.py for why not bytes), and the first reference is a real picture."""
    for label, got, want in zip(labels, images, reference):
        diff = np.abs(got - want)
        print(f"{label} SP=2 vs SP=1: max pixel difference {diff.max()}")
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (label, diff.max(), (diff > 0).mean())
    assert reference[0].std() > 10 and np.abs(reference[0][:, :, 0] - reference[0][:, :, 1]).mean() > 1


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(line) for line in out.split()]


def alive(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
