"""Fixtures of the connector tier shared by its modules."""

from __future__ import annotations

import pytest

from yuanrong_support import started_yuanrong_worker


@pytest.fixture(scope="session")
def yuanrong_worker():
    """One openYuanrong datasystem worker for this test process (tests/support/yuanrong_support.py)."""
    worker = started_yuanrong_worker(shared_memory_mb=512)
    yield worker
    worker.stop()
