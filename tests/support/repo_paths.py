"""Where things are, for tests in any tier folder: the repository root and the test support folder,
and the ``PYTHONPATH`` a test gives a Python script it runs in a fresh interpreter (the support
modules and ``conftest`` import by bare name, as under pytest, whose ``pythonpath`` setting in
pyproject.toml puts the same two folders on the path)."""

from __future__ import annotations

import os
import pathlib

SUPPORT_DIR = pathlib.Path(__file__).resolve().parent
TESTS_DIR = SUPPORT_DIR.parent
REPO_ROOT = TESTS_DIR.parent
PIPELINES_DIR = REPO_ROOT / "deploy" / "pipelines"


def script_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the tests' folders ahead on ``PYTHONPATH``."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), str(SUPPORT_DIR), env.get("PYTHONPATH", "")) if p)
    return env
