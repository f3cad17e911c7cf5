"""Every tiny-model builder writes weights that are a pure function of its seed.

A parameter that no init touches keeps whatever its ``torch.empty`` memory held: zeros on a fresh heap,
so tests pass here, and garbage (NaN, 1e16) on a machine or process whose heap was used before. Each
builder runs twice in a fresh interpreter under glibc's ``MALLOC_PERTURB_`` with two different fill
bytes (and the mmap threshold raised so large tensors come from the heap too): any weight that depends
on the fill differs between the two builds.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys

import pytest

from omnirelay.deploy.builders.llm import FAMILY_BUILDERS, MODEL_KIND
from repo_paths import script_env

# Every kind omni-make-model builds: name -> (module in omnirelay.deploy, function, keyword arguments).
BUILDERS = {MODEL_KIND: ("llm", "build_tiny_llm", {}), **FAMILY_BUILDERS}


def _digest_weights(root: pathlib.Path) -> dict[str, str]:
    """sha256 of every tensor in every safetensors file under ``root``, keyed 'file:tensor'; raises on a
    tensor that is not finite."""
    import torch
    from safetensors.torch import load_file

    digests = {}
    for path in sorted(root.rglob("*.safetensors")):
        for name, tensor in sorted(load_file(str(path)).items()):
            key = f"{path.relative_to(root)}:{name}"
            if tensor.is_floating_point() and not torch.isfinite(tensor.float()).all():
                raise AssertionError(f"{key} is not finite")
            digests[key] = hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    return digests


def _build_and_digest(out: pathlib.Path) -> dict[str, dict[str, str]]:
    """The child: dirty the heap the way a long process would, then build every family into ``out``."""
    import importlib

    import torch

    torch.set_num_threads(1)
    scratch = [torch.randn(256, 1024) for _ in range(64)]   # heap pages now hold the fill byte's leftovers
    del scratch
    digests = {}
    for name, (module, function, kwargs) in BUILDERS.items():
        build = getattr(importlib.import_module(f"omnirelay.deploy.builders.{module}"), function)
        digests[name] = _digest_weights(build(out / name, seed=0, **kwargs))
    return digests


def _run_child(tmp: pathlib.Path, fill: int) -> dict[str, dict[str, str]]:
    env = {**script_env(), "MALLOC_PERTURB_": str(fill), "MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024)}
    out = tmp / f"fill-{fill}"
    done = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "digests.json").read_text())


@pytest.mark.timeout(1800)   # two interpreters each build every family: ~1 min alone, 5+ on a busy host
def test_every_builder_writes_the_same_weights_whatever_the_heap_held(tmp_path):
    first, second = _run_child(tmp_path, 0x5A), _run_child(tmp_path, 0xC3)
    assert set(first) == set(BUILDERS)
    for name in BUILDERS:
        assert first[name], f"{name}: no weights written"
        differing = sorted(key for key in first[name] if first[name][key] != second[name].get(key))
        assert not differing, f"{name}: weights depend on leftover memory (uninitialized): {differing[:8]}"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        pytest.exit("usage: test_builders_deterministic.py OUT_DIR")
    _out = pathlib.Path(sys.argv[1])
    _out.mkdir(parents=True)
    (_out / "digests.json").write_text(json.dumps(_build_and_digest(_out)))
