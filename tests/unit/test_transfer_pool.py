"""The transfer pool's scheduling rules, on the real shared-memory connector: which jobs run inline
(a write on a connector whose writes are local) and which on a transfer thread, that a failed
inline write is discarded exactly once, and that an idle thread is reused, then ends by itself."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from omnirelay.connectors import Connector, create_connector
from omnirelay.connectors.timing import TimedConnector
from omnirelay.errors import TransferFailed
from omnirelay.workers.runtime.transfers import TransferPool, TransferState
from held_connector import HeldConnector


@dataclasses.dataclass
class _Put:
    """Put one small tensor; records the thread it ran on and every discard."""

    name: str
    deadline: float = dataclasses.field(default_factory=lambda: time.time() + 60)
    writes_only = True
    fail: bool = False
    ran_on: int = 0
    discards: int = 0

    def run(self, connector: Connector, timeout: float, scratch) -> dict:
        self.ran_on = threading.get_ident()
        handle = connector.put(self.name, {"x": torch.arange(4)})
        if self.fail:
            raise TransferFailed(f"{self.name}: failed on purpose after the put")
        return handle

    def discard(self, connector: Connector, result) -> None:
        self.discards += 1
        connector.delete(self.name)


@dataclasses.dataclass
class _Get(_Put):
    writes_only = False

    def run(self, connector: Connector, timeout: float, scratch) -> dict:
        self.ran_on = threading.get_ident()
        return connector.get(self.name, timeout=timeout)


@pytest.fixture
def shm(tmp_path):
    connector = create_connector("shared_memory", {"shm_dir": str(tmp_path)})
    yield connector
    connector.close()


def _wait_finished(ticket, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not ticket.finished and time.monotonic() < deadline:
        time.sleep(0.005)
    assert ticket.finished, ticket.state


def test_the_capability_is_declared_by_shared_memory_and_kept_by_wrappers(shm):
    assert shm.local_writes
    assert TimedConnector(shm).local_writes
    assert not HeldConnector(shm).local_writes   # a wrapper that can make writes wait must not claim it


def test_a_write_on_a_local_connector_runs_inline_and_comes_back_ready(shm):
    pool = TransferPool(shm, timeout_s=5, max_held=1, name="t")
    try:
        job = _Put("w/1")
        ticket = pool.submit(job)
        assert ticket.state is TransferState.READY and job.ran_on == threading.get_ident()
        assert not pool._workers   # no thread was started for it
        second = pool.submit(_Put("w/2"))   # max_held does not hold back an inline write
        assert second.state is TransferState.READY
        with pool.take(ticket) as handle:
            assert torch.equal(shm.get("w/1", handle)["x"], torch.arange(4))
        with pool.take(second):
            pass
    finally:
        pool.close()


def test_a_failed_inline_write_is_discarded_once_and_leaves_no_key(shm):
    pool = TransferPool(shm, timeout_s=5, max_held=2, name="t")
    try:
        job = _Put("w/failing", fail=True)
        ticket = pool.submit(job)
        assert ticket.state is TransferState.FAILED and isinstance(ticket.error, TransferFailed)
        assert job.discards == 1
        with pytest.raises(TransferFailed):
            shm.get("w/failing", timeout=0.1)
        pool.cancel(ticket)   # a cancel after the failure discards nothing more
        assert job.discards == 1
    finally:
        pool.close()


def test_reads_and_writes_that_can_wait_run_on_a_transfer_thread(shm):
    held = HeldConnector(shm)   # writes through it may wait: not local
    pool = TransferPool(held, timeout_s=5, max_held=4, name="t")
    try:
        write, read = _Put("w/remote"), _Get("w/local-read")
        shm.put("w/local-read", {"x": torch.arange(4)})
        tickets = [pool.submit(write), pool.submit(read)]
        for ticket in tickets:
            _wait_finished(ticket)
            assert ticket.state is TransferState.READY
        assert threading.get_ident() not in (write.ran_on, read.ran_on)
        for ticket in tickets:
            with pool.take(ticket):
                pass
    finally:
        pool.close()
    local_pool = TransferPool(shm, timeout_s=5, max_held=1, name="t")
    try:   # a get waits for its key even on a local connector
        read = _Get("w/local-read")
        ticket = local_pool.submit(read)
        _wait_finished(ticket)
        assert read.ran_on != threading.get_ident()
        with local_pool.take(ticket):
            pass
    finally:
        local_pool.close()


def test_an_idle_thread_takes_the_next_job_then_ends_by_itself(shm, monkeypatch):
    monkeypatch.setattr(TransferPool, "LINGER_S", 0.5)
    pool = TransferPool(HeldConnector(shm), timeout_s=5, max_held=2, threads=1, name="t")
    try:
        shm.put("k/1", {"x": torch.arange(4)})
        first, second = _Get("k/1"), _Get("k/1")
        ticket = pool.submit(first)
        _wait_finished(ticket)
        with pool.take(ticket):
            pass
        (thread,) = pool._workers
        ticket = pool.submit(second)   # within LINGER_S: the same thread runs it
        _wait_finished(ticket)
        with pool.take(ticket):
            pass
        assert second.ran_on == first.ran_on == thread.ident
        thread.join(5)
        assert not thread.is_alive()   # idle for LINGER_S: an idle pool holds no thread
    finally:
        pool.close()


def test_close_ends_a_lingering_thread_at_once(shm, monkeypatch):
    monkeypatch.setattr(TransferPool, "LINGER_S", 30)
    pool = TransferPool(HeldConnector(shm), timeout_s=5, max_held=1, threads=1, name="t")
    shm.put("k/2", {"x": torch.arange(4)})
    ticket = pool.submit(_Get("k/2"))
    _wait_finished(ticket)
    (thread,) = pool._workers
    started = time.monotonic()
    pool.close()   # the READY result is discarded; the idle thread wakes and ends
    assert not thread.is_alive() and time.monotonic() - started < TransferPool.CLOSE_JOIN_S


def test_a_job_held_back_by_max_held_starts_when_a_result_is_taken(shm, monkeypatch):
    """The idle thread is woken when room frees up under max_held: the queued job does not wait
    out the thread's linger time."""
    monkeypatch.setattr(TransferPool, "LINGER_S", 30)
    pool = TransferPool(HeldConnector(shm), timeout_s=5, max_held=1, threads=1, name="t")
    try:
        shm.put("k/3", {"x": torch.arange(4)})
        first = pool.submit(_Get("k/3"))
        _wait_finished(first)
        second = pool.submit(_Get("k/3"))
        time.sleep(0.1)
        assert second.state is TransferState.QUEUED   # one result held already
        with pool.take(first):
            pass
        _wait_finished(second, timeout=5)
        with pool.take(second):
            pass
    finally:
        pool.close()
