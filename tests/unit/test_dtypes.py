"""``--dtype auto``: the checkpoint's dtype, adjusted to where it runs (workers/runtime/dtypes.py)."""

from __future__ import annotations

import json

import pytest

from omnirelay.workers.runtime import dtypes
from omnirelay.workers.runtime.config import WorkerConfig


def _model(tmp_path, **config) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("config, saved", [
    ({"torch_dtype": "bfloat16"}, "bfloat16"),
    ({"dtype": "float16"}, "float16"),                                        # transformers 5's spelling
    ({"thinker_config": {"text_config": {"torch_dtype": "bfloat16"}}}, "bfloat16"),   # an omni checkpoint
    ({"torch_dtype": "float32"}, "float32"),
    ({}, None),
    ({"torch_dtype": "int8"}, None),
])
def test_checkpoint_dtype_is_read_from_config(tmp_path, config, saved):
    assert dtypes.checkpoint_dtype(_model(tmp_path, **config)) == saved


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "no-bf16"])
def test_auto_follows_the_checkpoint_and_the_cpu(tmp_path, monkeypatch, native):
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: native)
    reduced = "bfloat16" if native else "float32"
    for saved, on_cpu, on_cuda in (("bfloat16", reduced, "bfloat16"), ("float16", reduced, "float16"),
                                   ("float32", "float32", "float32")):
        path = _model(tmp_path, torch_dtype=saved)
        assert dtypes.resolve_dtype("auto", path, on_cuda=False) == on_cpu
        assert dtypes.resolve_dtype("auto", path, on_cuda=True) == on_cuda
    assert dtypes.resolve_dtype("auto", _model(tmp_path), on_cuda=False) == "float32"   # none named
    assert dtypes.resolve_dtype("float16", _model(tmp_path, torch_dtype="bfloat16"), on_cuda=False) == "float16"


def test_worker_config_resolves_auto_once(tmp_path, monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(WorkerConfig, "_on_cuda", lambda self: False)
    config = WorkerConfig(role="decode", model_path=_model(tmp_path, torch_dtype="bfloat16"), model_name="m")
    assert config.dtype == "bfloat16"
    assert WorkerConfig(role="decode", model_path=_model(tmp_path, torch_dtype="float32"), model_name="m").dtype == "float32"
    with pytest.raises(ValueError, match="unsupported dtype"):
        WorkerConfig(role="decode", model_path=str(tmp_path), model_name="m", dtype="int4")

