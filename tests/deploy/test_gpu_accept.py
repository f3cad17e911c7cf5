"""``benchmarks/gpu_accept.sh --dry-run``: the device acceptance check's stages on the CPU at toy sizes.

The check itself is for a lent GPU machine, which CI never has; its dry run takes the same stages
(install, models, parity, serve, KV hand-off, decode profile, TP/EP over gloo) through the same code
on the CPU, so the day a refactor breaks a stage, this test says which. It runs in this Python
(everything already imports, so nothing is installed) and reads the JSON summary the script writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from repo_paths import REPO_ROOT

STAGES = ("device", "install", "models", "parity", "serve", "kv-handoff", "decode", "tp-ep")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_dry_run_passes_every_stage(tmp_path):
    out = tmp_path / "out"
    # A wider budget than the script's own 115 s: CI runs two test files at once on two cores.
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "GPU_ACCEPT_BUDGET_S": "300"}
    proc = subprocess.run(["bash", str(REPO_ROOT / "benchmarks" / "gpu_accept.sh"), "--dry-run"], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=400)
    assert (out / "gpu_accept.log").read_text().strip(), "the log is teed to $OUT"
    summary = json.loads((out / "gpu_accept.json").read_text())
    statuses = {s["name"]: s["status"] for s in summary["stages"]}
    assert proc.returncode == 0 and summary["passed"], proc.stdout[-6000:]
    assert statuses == {name: "pass" for name in STAGES}, statuses
    assert summary["mode"] == "dry-run" and summary["device"] == "cpu"
    parity = summary["stages"][STAGES.index("parity")]["detail"]["families"]
    assert set(parity) == {"qwen2 float32", "qwen3 float32", "qwen3-moe float32", "qwen3-moe bfloat16"}
    assert any(line.startswith("| stage | status |") for line in proc.stdout.splitlines()[-12:]), \
        "the summary table is printed last"
