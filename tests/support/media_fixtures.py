"""Module-scoped fixtures the media test modules declare alike (not a test module): a tiny model
built once, its diffusers pipeline, a cluster serving it and an ``openai`` client on that cluster.
Each factory returns a fixture; a module binds it to the name its tests ask for, e.g.
``tiny_sd = tiny_model_fixture("tiny-sd", build_tiny_text_to_image)`` then
``pipe = pipeline_fixture("tiny_sd")``, where the string names the model fixture to load.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from media_support import openai_client, pipeline_cluster, tiny_model_dir
from repo_paths import REPO_ROOT

PIPELINES = REPO_ROOT / "deploy" / "pipelines"


def pipeline_file(name: str) -> str:
    """The path of ``deploy/pipelines/NAME.yaml``."""
    return str(PIPELINES / f"{name}.yaml")


def tiny_model_fixture(name: str, build: Callable, *, one_thread: bool = False):
    """``build(DIR, seed=0)`` once per module into a fresh ``models/name``; ``one_thread`` builds
    with one torch thread (as the DiT builders are run)."""
    @pytest.fixture(scope="module")
    def model_dir(tmp_path_factory) -> str:
        if one_thread:
            torch.set_num_threads(1)
        return tiny_model_dir(tmp_path_factory, name, build)
    return model_dir


def pipeline_fixture(model_fixture: str):
    """The diffusers pipeline of the model directory the fixture ``model_fixture`` gives, loaded once
    per module with one torch thread."""
    @pytest.fixture(scope="module")
    def pipe(request):
        model_dir = request.getfixturevalue(model_fixture)
        torch.set_num_threads(1)
        from omnirelay.workers.generate.image import load_pipeline
        return load_pipeline(model_dir)
    return pipe


def cluster_fixture(model_fixture: str, model_name: str, pipeline: str, log_name: str):
    """A broker, one generate worker and the gateway serving the fixture ``model_fixture``'s model as
    ``model_name`` on ``pipeline``, once per module (logs under a temporary ``log_name``)."""
    @pytest.fixture(scope="module")
    def cluster(request, tmp_path_factory):
        with pipeline_cluster(request.getfixturevalue(model_fixture), str(tmp_path_factory.mktemp(log_name)),
                              model_name, pipeline, ("generate",)) as cluster:
            yield cluster
    return cluster


def client_fixture(timeout: float = 120):
    """The official client on the module's ``cluster`` fixture."""
    @pytest.fixture(scope="module")
    def client(cluster):
        return openai_client(cluster, timeout=timeout)
    return client
