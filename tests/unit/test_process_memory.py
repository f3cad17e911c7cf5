"""A process's unshared memory, as the workers report it (omnirelay/process_memory.py)."""

from __future__ import annotations

import pytest


def test_private_memory_counts_what_this_process_writes():
    """Private_Dirty grows by what the process writes, not by what it maps (omnirelay/process_memory.py)."""
    import mmap
    from omnirelay.process_memory import private_bytes
    before = private_bytes()
    if before is None:
        pytest.skip("no /proc/self/smaps_rollup here")
    # Fresh anonymous pages, one byte written in each: a heap allocation could reuse pages an
    # earlier test in this process freed (already dirty, so nothing would grow).
    size = 64 << 20
    block = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        block[offset] = 1
    assert private_bytes() - before >= 60 << 20
    block.close()
    assert private_bytes(999_999_999) is None          # no such process

