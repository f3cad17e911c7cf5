"""pyproject.toml's explicit package list names every package in the tree.

The editable install used here finds a subpackage missing from the list anyway (it searches the
mapped folder), so every other test passes while a wheel built from the same tree leaves the
subpackage out and ``omni-worker`` fails to import on the user's host.
"""

from __future__ import annotations

import tomllib
from repo_paths import REPO_ROOT

ROOT = REPO_ROOT


def test_every_package_folder_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, folders = set(setuptools["packages"]), setuptools["package-dir"]
    on_disk = set()
    for package, folder in folders.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            relative = init.parent.relative_to(base).parts
            on_disk.add(".".join((package, *relative)))
    assert on_disk - listed == set(), "packages on disk that pyproject.toml does not list"
    assert listed - on_disk == set(), "pyproject.toml lists packages with no folder"
