"""The ``mooncake_transfer_engine`` connector's in-place put and its freed-block quarantine.

Producer and consumer are two connectors of this process, each with its own transfer engine, and
every transfer is a real one over the engine's TCP transport. Tests that need a slow read, or a
block recycled in the middle of one, wrap the consumer's engine in :class:`EngineSpy`. The pair is
shared by the module (a connector takes about a second to close), so tests compare counters before
and after; the ones that need a fresh pool open their own producer.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import time
import uuid

import pytest
import torch

from connector_peer import make_payload, same_payload
from connector_servers import mooncake_skip_reason
from omnirelay.connectors import create_connector
from omnirelay.errors import TransferFailed


SKIP_REASON = mooncake_skip_reason("mooncake.engine")
pytestmark = [pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or ""), pytest.mark.timeout(60)]


@pytest.fixture
def te():
    return importlib.import_module("omnirelay.connectors.mooncake_transfer_engine")


@pytest.fixture(scope="module")
def directory():
    path = f"/dev/shm/ortest-te-inplace-{uuid.uuid4().hex}"
    yield path
    left = sorted(os.listdir(path)) if os.path.isdir(path) else []
    shutil.rmtree(path, ignore_errors=True)
    assert left == [], f"directory entries left behind: {left}"


def _open(directory: str, pool_mb: float = 8):
    try:
        return create_connector("mooncake_transfer_engine", {"directory": directory, "pool_mb": pool_mb})
    except TransferFailed as exc:   # e.g. the engine cannot start in this sandbox
        pytest.skip(f"mooncake_transfer_engine unavailable: {exc}")


@pytest.fixture(scope="module")
def pair(directory):
    producer = _open(directory)
    consumer = _open(directory)
    yield producer, consumer
    producer.close()
    consumer.close()


@pytest.fixture
def producer(pair):
    return pair[0]


@pytest.fixture
def consumer(pair):
    return pair[1]


@pytest.fixture
def fresh_producer(directory):
    """A producer of its own: an empty pool, so block addresses are predictable (first fit)."""
    conn = _open(directory, pool_mb=0.25)
    yield conn
    conn.close()


def counter(conn, name: str) -> int:
    return conn.health().get(name, 0)


def put_in_place(conn, key: str, payload: dict) -> tuple[dict, int]:
    """Publish ``payload``'s tensors through reserve → fill → put_reserved, its other items as
    ``extra``; returns the handle and the address of the block the tensors were reserved in."""
    tensors = {n: v for n, v in payload.items() if isinstance(v, torch.Tensor)}
    extra = {n: v for n, v in payload.items() if not isinstance(v, torch.Tensor)}
    reservation = conn.reserve({n: (tuple(t.shape), t.dtype) for n, t in tensors.items()})
    for name, tensor in tensors.items():
        reservation.tensors[name].copy_(tensor)
    reserved_at = reservation.memory.memory.address
    return conn.put_reserved(key, reservation, extra), reserved_at


def small_payload(seed: int, nbytes: int = 64 << 10) -> dict:
    return {"t": torch.full((nbytes // 4,), seed, dtype=torch.int32)}


class EngineSpy:
    """Stands in for a connector's transfer engine: records every read's length, makes payload
    reads (anything longer than the header) last ``delay_s`` more, and runs ``after_payload_read``
    once, right after the first payload read."""

    def __init__(self, engine, header_size: int, delay_s: float = 0.0, after_payload_read=None):
        self.engine, self.header_size, self.delay_s = engine, header_size, delay_s
        self.after_payload_read = after_payload_read
        self.reads: list[int] = []

    def transfer_sync_read(self, peer, dst, src, length):
        rc = self.engine.transfer_sync_read(peer, dst, src, length)
        self.reads.append(length)
        if length > self.header_size:
            time.sleep(self.delay_s)
            hook, self.after_payload_read = self.after_payload_read, None
            if hook is not None:
                hook()
        return rc

    def __getattr__(self, name):
        return getattr(self.engine, name)


@contextlib.contextmanager
def spying(conn, te, **options):
    spy = EngineSpy(conn._engine, te.HEADER.size, **options)
    conn._engine = spy
    try:
        yield spy
    finally:
        conn._engine = spy.engine   # close() must drop the real engine, or its threads outlive it


# ------------------------------------------------------------------------------- in-place put


def test_reserved_tensors_publish_in_place_and_round_trip(producer, consumer):
    payload = make_payload(7, big_mb=0.5)   # every dtype, scalar and empty shapes, bytes and values
    puts = counter(producer, "puts")
    handle, reserved_at = put_in_place(producer, "kv/inplace", payload)
    assert handle["addr"] == reserved_at   # published from the reserved block: no copy
    assert same_payload(consumer.get("kv/inplace", handle, timeout=5), payload) == []
    assert same_payload(consumer.get("kv/inplace", timeout=5), payload) == []   # key only
    consumer.delete("kv/inplace")
    assert counter(producer, "puts") == puts + 1 and counter(producer, "reservations_open") == 0
    assert counter(producer, "reserved_copied") == 0


def test_put_reserved_publishes_like_put(producer, consumer):
    payload = {"a": torch.arange(10, dtype=torch.float32), "b": b"xyz", "c": {"n": 1}}
    copied = producer.put("kv/copied", payload)
    in_place, _ = put_in_place(producer, "kv/in-place", payload)
    assert set(in_place) == set(copied) and in_place["peer"] == copied["peer"]
    assert in_place["gen"] == copied["gen"] + 1
    for key in ("kv/copied", "kv/in-place"):
        assert same_payload(consumer.get(key, timeout=5), payload) == []
        consumer.delete(key)


def test_reservation_is_used_once(producer):
    used = producer.reserve({"t": ((4,), torch.int64)})
    used.tensors["t"].fill_(1)
    producer.put_reserved("kv/once", used)
    with pytest.raises(ValueError):
        producer.put_reserved("kv/once", used)
    released = producer.reserve({"t": ((4,), torch.int64)})
    producer.release(released)
    producer.release(released)   # idempotent
    with pytest.raises(ValueError):
        producer.put_reserved("kv/twice", released)
    assert producer.health()["reservations_open"] == 0
    producer.delete("kv/once")


def test_release_returns_the_block_to_the_pool(producer):
    reservation = producer.reserve({"k": ((256, 1024), torch.bfloat16), "v": ((0, 8), torch.float16)})
    lent = reservation.memory.memory.size
    assert lent >= 512 * 1024 and counter(producer, "reservations_open") == 1
    held = counter(producer, "pool_in_use")
    producer.release(reservation)
    assert reservation.done and reservation.tensors == {}
    assert counter(producer, "pool_in_use") == held - lent and counter(producer, "reservations_open") == 0


def test_clashing_extra_is_refused_and_releases_the_reservation(producer):
    reservation = producer.reserve({"t": ((4,), torch.int64)})
    lent, held = reservation.memory.memory.size, counter(producer, "pool_in_use")
    with pytest.raises(ValueError):
        producer.put_reserved("kv/clash", reservation, {"t": 1})
    assert reservation.done and counter(producer, "pool_in_use") == held - lent


@pytest.mark.parametrize("extra", [{"meta": "m" * 5000},           # header beyond the room kept for it
                                   {"blob": bytes(range(256)) * 64}],   # data beyond the block's room
                         ids=["header_overflow", "extra_data_overflow"])
def test_extras_that_do_not_fit_fall_back_to_a_copy(producer, consumer, extra):
    tensors = {"t": torch.arange(1000, dtype=torch.int16)}
    copied = counter(producer, "reserved_copied")
    handle, reserved_at = put_in_place(producer, "kv/overflow", {**tensors, **extra})
    assert handle["addr"] != reserved_at and counter(producer, "reserved_copied") == copied + 1
    assert same_payload(consumer.get("kv/overflow", handle, timeout=5), {**tensors, **extra}) == []
    consumer.delete("kv/overflow")
    assert producer.health()["reservations_open"] == 0


# -------------------------------------------------------------------------------- quarantine


def test_acknowledged_block_is_not_reused_before_its_quarantine_ends(fresh_producer, consumer, te, monkeypatch):
    producer = fresh_producer
    monkeypatch.setattr(producer, "quarantine_s", 0.5)
    first = producer.put("q/0", small_payload(0))
    consumer.get("q/0", first, timeout=5)
    consumer.delete("q/0")                       # acknowledges: the producer retires it on its next put
    acked_at = time.monotonic()
    during = [producer.put(f"q/{i}", small_payload(i))["addr"] for i in (1, 2)]
    assert time.monotonic() - acked_at < producer.quarantine_s, "machine too slow for this check"
    assert first["addr"] not in during
    assert producer.health()["blocks_quarantined"] == 1
    time.sleep(producer.quarantine_s)
    assert producer.put("q/3", small_payload(3))["addr"] == first["addr"]   # first fit: back in the pool
    for i in (1, 2, 3):
        producer.delete(f"q/{i}")


def test_exhausted_pool_takes_a_one_off_region_rather_than_recycle_early(fresh_producer, consumer, te,
                                                                         monkeypatch):
    producer = fresh_producer
    monkeypatch.setattr(producer, "quarantine_s", 30.0)
    capacity = producer.health()["pool_bytes"]
    first = producer.put("q/big", small_payload(0, 200 << 10))   # the pool's first block: its start
    producer.delete("q/big")
    second = producer.put("q/big", small_payload(1, 200 << 10))
    assert not first["addr"] <= second["addr"] < first["addr"] + capacity   # outside the pool
    assert same_payload(consumer.get("q/big", second, timeout=5), small_payload(1, 200 << 10)) == []
    consumer.delete("q/big")
    producer.close()
    health = producer.health()
    assert health["blocks_quarantined"] == 0 and health["pool_in_use"] == 0   # close frees quarantined blocks


def test_quick_read_is_trusted_without_a_second_header_read(producer, consumer, te, monkeypatch):
    monkeypatch.setattr(producer, "quarantine_s", 10.0)
    handle = producer.put("r/quick", small_payload(5))
    assert handle["q"] == 10.0
    with spying(consumer, te) as spy:
        assert same_payload(consumer.get("r/quick", handle, timeout=5), small_payload(5)) == []
    assert spy.reads == [te.HEADER.size + handle["size"]]
    consumer.delete("r/quick")


def test_slow_read_reads_the_generation_again(producer, consumer, te, monkeypatch):
    monkeypatch.setattr(producer, "quarantine_s", 0.02)
    handle = producer.put("r/slow", small_payload(6))
    rechecked = counter(consumer, "reads_rechecked")
    with spying(consumer, te, delay_s=0.02) as spy:
        assert same_payload(consumer.get("r/slow", handle, timeout=5), small_payload(6)) == []
    assert spy.reads == [te.HEADER.size + handle["size"], te.HEADER.size]
    assert counter(consumer, "reads_rechecked") == rechecked + 1
    consumer.delete("r/slow")


def test_block_recycled_during_a_slow_read_is_detected(fresh_producer, consumer, te, monkeypatch):
    """No quarantine (the default): while the consumer's payload read is in flight the producer puts the key
    again and hands the old block to another payload. The second header read sees a different
    generation, so the get looks the key up again and returns the new payload."""
    producer = fresh_producer
    old = producer.put("r/recycled", small_payload(1))
    assert "q" not in old   # the default: no quarantine, every read is checked twice
    reused = {}

    def recycle():
        producer.put("r/recycled", small_payload(2))                      # old block freed
        reused["addr"] = producer.put("r/other", small_payload(3))["addr"]  # and written again

    with spying(consumer, te, after_payload_read=recycle) as spy:
        got = consumer.get("r/recycled", old, timeout=5)
    assert reused["addr"] == old["addr"]
    assert same_payload(got, small_payload(2)) == []
    full = te.HEADER.size + old["size"]
    assert spy.reads == [full, te.HEADER.size, full, te.HEADER.size]   # the retry is checked twice too
    consumer.delete("r/recycled")
    producer.delete("r/other")
