"""What the shared-memory connector tests share: the private directory guard, a connector fixture,
readers of a shm directory's layout, and a payload maker and comparison (from ``shm_child.py``, the
child process's entry point, so both sides build and check payloads alike).

Every test works in a private directory ``/dev/shm/ortest-<uuid>/`` (the ``shm_dir`` fixture; never in
/dev/shm itself, whose ``omnirelay-*`` segments may belong to other processes) and must leave it empty.

Layout (see the module): one key entry (a symlink ``omnirelay-<pid>-<key hash>``) per published key,
pooled segments ``omnirelay-<pid>-c<n>-s<m>`` that a producer reuses, and its owner file
``omnirelay-<pid>-c<n>-owner`` while its connector is open.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pathlib
import re

import pytest
import torch

from omnirelay.connectors.shared_memory import PREFIX, SharedMemoryConnector

HERE = pathlib.Path(__file__).resolve().parent
CHILD = HERE / "shm_child.py"

_spec = importlib.util.spec_from_file_location("_omnirelay_shm_child", CHILD)
shm_child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shm_child)


@pytest.fixture(autouse=True)
def no_segments_in_real_dev_shm():
    """Nothing this process does may land in the real /dev/shm."""
    pattern = f"/dev/shm/{PREFIX}{os.getpid()}-*"
    before = set(glob.glob(pattern))
    yield
    assert set(glob.glob(pattern)) == before


@pytest.fixture
def conn(shm_dir):
    c = SharedMemoryConnector({"shm_dir": shm_dir})
    yield c
    c.close()


def files(shm_dir) -> list[str]:
    return sorted(os.listdir(shm_dir))


def keys_in(shm_dir) -> list[str]:
    """Key entries: one per published key."""
    return sorted(n for n in os.listdir(shm_dir) if os.path.islink(os.path.join(shm_dir, n)))


def segments_in(shm_dir) -> list[str]:
    return sorted(n for n in os.listdir(shm_dir) if re.fullmatch(rf"{PREFIX}\d+-c\d+-s\d+", n))


def assert_same(got: dict, want: dict) -> None:
    assert shm_child.same_payload(got, want) == []


def small_payload(i: int = 0) -> dict:
    return {"t": torch.arange(10, dtype=torch.float32) + i, "b": b"raw%d" % i, "v": {"i": i}}
