"""A process's unshared memory, as the workers report it (omnirelay/process_memory.py)."""

from __future__ import annotations

import pytest


def test_private_memory_counts_what_this_process_writes():
    """Private_Dirty grows by what the process writes, not by what it maps (omnirelay/process_memory.py)."""
    import torch
    from omnirelay.process_memory import private_bytes
    before = private_bytes()
    if before is None:
        pytest.skip("no /proc/self/smaps_rollup here")
    block = torch.ones(64 << 20, dtype=torch.uint8)   # 64 MiB written
    assert private_bytes() - before >= 60 << 20
    del block
    assert private_bytes(999_999_999) is None          # no such process

