"""``benchmarks/connectors.py --baseline REV`` (not a benchmark script of its own): the
``connectors`` package as of a git revision, extracted into a temporary directory as package
:data:`BASELINE_PACKAGE`, and a connector of it built in a child process beside the current one.
The parent names the directory in ``OMNIRELAY_BENCH_BASELINE``, which the children inherit.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

BASELINE_PACKAGE = "omnirelay_bench_baseline"
BASELINE_DIR_ENV = "OMNIRELAY_BENCH_BASELINE"


def extract_baseline(rev: str, into: str) -> str:
    """Write the ``connectors`` package as of git revision ``rev`` under ``into`` (as package
    :data:`BASELINE_PACKAGE`); returns the short revision. Its modules import each other
    relatively, so they load side by side with the current ones."""
    root = Path(__file__).resolve().parent.parent
    git = ["git", "-C", str(root)]
    short = subprocess.run([*git, "rev-parse", "--short", rev], check=True, capture_output=True, text=True).stdout.strip()
    names = subprocess.run([*git, "ls-tree", "--name-only", rev, "connectors/"], check=True, capture_output=True,
                           text=True).stdout.split()
    package = Path(into) / BASELINE_PACKAGE
    package.mkdir()
    for name in names:
        if name.endswith(".py"):
            source = subprocess.run([*git, "show", f"{rev}:{name}"], check=True, capture_output=True).stdout
            (package / Path(name).name).write_bytes(source)
    return short


def baseline_connector(name: str, options: dict):
    """The connector ``name`` built from the extracted package (in a child process)."""
    from omnirelay.connectors import registry
    sys.path.insert(0, os.environ[BASELINE_DIR_ENV])
    module_name, class_name = registry._BACKENDS[name].split(":")
    module = importlib.import_module(module_name.replace("omnirelay.connectors.", f"{BASELINE_PACKAGE}."))
    return getattr(module, class_name)(options)
