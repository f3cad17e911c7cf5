"""The openYuanrong datasystem worker for the tests (not a test module): one single-node
``datasystem_worker`` per test process (the session fixture :func:`yuanrong_worker`, imported by the
modules that use it; it takes ~6 s to come up), started by
:class:`omnirelay.deploy.yuanrong_worker.LocalYuanrongWorker` on free ports of 127.0.0.1 in a private
directory, and stopped by its process group, the directory removed.

A host without the package, or where the worker cannot start, skips with the precise reason.
"""

from __future__ import annotations

import tempfile

import pytest


def yuanrong_skip_reason() -> str | None:
    """Why the yuanrong backend cannot run here, or None."""
    try:
        from omnirelay.deploy.yuanrong_worker import YuanrongUnavailable, worker_binary
        worker_binary()
        import yr.datasystem.kv_client  # noqa: F401 - its shared library must load too
    except YuanrongUnavailable as exc:
        return f"yuanrong unavailable: {exc}"
    except (ImportError, OSError) as exc:
        return f"yuanrong unavailable: the datasystem client does not load: {exc}"
    return None


def started_yuanrong_worker(**options):
    """A running ``datasystem_worker`` (the caller stops it), or the test skipped with the reason.
    Its directory is short on purpose: the worker refuses unix socket paths over 80 characters."""
    from omnirelay.deploy.yuanrong_worker import LocalYuanrongWorker, YuanrongUnavailable

    reason = yuanrong_skip_reason()
    if reason:
        pytest.skip(reason)
    worker = LocalYuanrongWorker(tempfile.mkdtemp(prefix="ortest-yr-"), **options)
    try:
        return worker.start()
    except YuanrongUnavailable as exc:
        pytest.skip(f"yuanrong unavailable: {exc}")


_SHARED: dict = {"worker": None, "users": 0}


@pytest.fixture(scope="session")
def yuanrong_worker():
    """One datasystem worker for this test process, started at its first use and stopped when the
    session ends. Modules import this fixture (a ``conftest.py`` in ``tests/connectors`` would shadow
    ``tests/conftest.py``, which the tests import as ``conftest``); pytest then holds one fixture per
    importing module, so they share the worker and the last one to finish stops it."""
    if _SHARED["worker"] is None or not _SHARED["worker"].running:
        _SHARED["worker"] = started_yuanrong_worker(shared_memory_mb=512)
    _SHARED["users"] += 1
    yield _SHARED["worker"]
    _SHARED["users"] -= 1
    if _SHARED["users"] == 0:
        _SHARED["worker"].stop()
        _SHARED["worker"] = None
