"""The role table: which (role, model kind) a worker can be built for, and the refusal of the rest.

The table must cover exactly the roles the bundled pipelines give each model kind (a pipeline role
without a builder would start a worker that cannot serve; a builder no pipeline uses is dead), and
``omni-worker`` must refuse a role the model's kind has no builder for before it loads anything.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from omnirelay.deploy.served_models import BUNDLED, PIPELINES_BY_KIND
from omnirelay.model_kind import ModelKind
from omnirelay.pipeline import default_llm_pipeline, load_pipeline
from omnirelay.workers.role_table import ROLE_BUILDERS, UnsupportedRole, role_builder


def _pipeline_roles() -> set[tuple[str, ModelKind]]:
    pairs = {(role, ModelKind.LLM) for role in default_llm_pipeline("shared_memory", {}).roles}
    for kind, files in PIPELINES_BY_KIND.items():
        for name in files:
            pairs |= {(role, kind) for role in load_pipeline(str(BUNDLED / name)).roles}
    return pairs


def test_the_table_covers_exactly_the_roles_of_the_bundled_pipelines():
    assert set(ROLE_BUILDERS) == set(ModelKind)
    assert {(role, kind) for kind, builders in ROLE_BUILDERS.items() for role in builders} == _pipeline_roles()


def test_every_entry_is_found_by_the_lookup():
    for kind, builders in ROLE_BUILDERS.items():
        for role, builder in builders.items():
            assert role_builder(role, kind) is builder


@pytest.mark.parametrize("role, kind, roles", [
    ("encode", ModelKind.LLM, "prefill, decode"),
    ("generate", ModelKind.LLM, "prefill, decode"),
    ("prefill", ModelKind.TEXT_TO_IMAGE, "generate"),
    ("decode", ModelKind.QWEN3_TTS, "generate"),
    ("encode", ModelKind.TEXT_TO_VIDEO, "generate"),
])
def test_a_role_the_kind_lacks_is_refused_with_the_roles_it_has(role, kind, roles):
    with pytest.raises(UnsupportedRole) as info:
        role_builder(role, kind)
    assert isinstance(info.value, ValueError)   # omni-worker's argument errors: exit status 2
    assert str(info.value) == f"a model of kind {kind.value!r} has no {role!r} role (its roles: {roles})"


@pytest.mark.parametrize("role, pipeline", [("encode", "omni.yaml"), ("generate", None)])
def test_omni_worker_refuses_a_role_of_another_kind_before_loading(tiny_model, role, pipeline):
    """A text-only model as an encode worker (the Omni pipeline has that stage) or as a generate
    worker: exit status 2 with the reason, before the model or a connector is opened (the broker
    endpoint is never reached: nothing listens there)."""
    argv = [sys.executable, "-m", "omnirelay.workers.daemon", "--role", role, "--model", tiny_model,
            "--broker", "tcp://127.0.0.1:9"]
    if pipeline:
        argv += ["--stage-configs-path", str(BUNDLED / pipeline)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"a model of kind 'llm' has no '{role}' role (its roles: prefill, decode)" in proc.stderr
    assert "Traceback" not in proc.stderr
