"""A quantized checkpoint is refused at start-up by name, never served as garbage (until issue #36).

The compact engine reads every tensor as a dense float; a GPTQ/AWQ checkpoint's packed int32 weights
or a compressed-tensors/FP8 checkpoint's int8/fp8 ones would load as numbers and answer nonsense.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from omnirelay.workers.llm.models.llama import LlamaConfig, QuantizedCheckpointError
from omnirelay.workers.role_table import check_config
from omnirelay.workers.runtime.config import WorkerConfig

METHODS = ["gptq", "awq", "compressed-tensors", "fp8", "bitsandbytes"]


def _quantized_copy(tiny_model, tmp_path, method: str, nest: str = "") -> str:
    out = tmp_path / f"q-{method}"
    shutil.copytree(tiny_model, out)
    raw = json.loads((out / "config.json").read_text())
    quant = {"quant_method": method, "bits": 4}
    if nest:
        raw[nest] = {**raw.get(nest, {}), "quantization_config": quant}
    else:
        raw["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(raw))
    return str(out)


@pytest.mark.parametrize("method", METHODS)
def test_each_quantization_method_is_refused_by_name(tiny_model, tmp_path, method):
    path = _quantized_copy(tiny_model, tmp_path, method)
    with pytest.raises(QuantizedCheckpointError, match=f"quant_method '{method}'"):
        LlamaConfig.from_dir(__import__("pathlib").Path(path))
    for role in ("prefill", "decode"):   # the worker's start-up checks, before any weight loads
        with pytest.raises(QuantizedCheckpointError, match="not served yet"):
            check_config(WorkerConfig(role=role, model_path=path, model_name="q"))


def test_a_nested_text_config_is_read_too(tiny_model, tmp_path):
    path = _quantized_copy(tiny_model, tmp_path, "awq", nest="text_config")
    with pytest.raises(QuantizedCheckpointError, match="'awq'"):
        LlamaConfig.from_dir(__import__("pathlib").Path(path))


def test_omni_worker_exits_2_naming_the_method(tiny_model, tmp_path):
    path = _quantized_copy(tiny_model, tmp_path, "gptq")
    done = subprocess.run([sys.executable, "-m", "omnirelay.workers.daemon", "--role", "decode", "--model", path,
                           "--broker", "ipc:///nonexistent"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "quant_method 'gptq'" in done.stderr
