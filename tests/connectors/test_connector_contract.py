"""One contract suite, run against every connector backend.

Producer and consumer sit in different processes: this test process is one side, long-lived
peers (``tests/support/connector_peer.py``) are the other. Redis and the Mooncake master are real servers
started on free ports of 127.0.0.1 by the fixtures below and stopped by PID; the openYuanrong
datasystem worker is started once per test process (``yuanrong_worker``, ``yuanrong_support.py``)
and stopped by its process group. Each backend's
section ends by checking it left nothing behind: no shared memory file, Redis key, directory entry
or Mooncake object. The in-place path (``reserve`` → ``put_reserved`` → ``release``) runs through
the same checks, in both directions, and its tests also watch the health counters that describe
held memory (a reservation given back must leave them where they were).

A backend whose library or server cannot run here is skipped with the precise reason.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import threading
import time
import uuid

import msgpack
import pytest
import torch

from connector_peer import make_payload, put_reserved, same_payload
from connector_servers import Peer, mooncake_skip_reason, started_mooncake_master, started_redis
from yuanrong_support import yuanrong_worker  # noqa: F401 - the session's datasystem worker
from omnirelay.connectors import Connector, available_connectors, create_connector
from omnirelay.errors import TransferFailed

BACKENDS = ["shared_memory", "redis", "mooncake_transfer_engine", "mooncake_store", "yuanrong"]

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------------------- servers



def _still_readable(name: str, options: dict, keys) -> list[str]:
    """The keys a fresh client of the store ``name`` can still read: what a test left behind in a
    store that has no listing of its own (Yuanrong, Mooncake's store)."""
    probe = create_connector(name, options)
    try:
        left = []
        for key in sorted(keys):
            try:
                probe.get(key, timeout=0)
                left.append(key)
            except TransferFailed:
                pass
        return left
    finally:
        probe.close()

@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = started_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    master = started_mooncake_master(tmp_path_factory.mktemp("mooncake"))
    yield master
    master.stop()


# ---------------------------------------------------------------------------------- backends


@pytest.fixture(scope="module")
def peers():
    """Two peer processes, shared by every backend of this module (each backend opens its own
    connector in them)."""
    started = [Peer(), Peer()]
    yield started
    for peer in started:
        peer.close()


class Backend:
    """One backend under test: its options, this process's connector, the peers' connectors, and
    a check that it left nothing behind."""

    def __init__(self, name: str, options: dict, leftovers, peers: list[Peer]):
        self.name, self.options, self._leftovers = name, options, leftovers
        try:
            self.conn = create_connector(name, options)
        except TransferFailed as exc:   # e.g. Mooncake's engine cannot start in this sandbox
            pytest.skip(f"{name} unavailable: {exc}")
        self.peers = peers
        for peer in self.peers:
            peer.open(name, options)
        self.keys: set[str] = set()

    def key(self, label: str) -> str:
        key = f"{label}/{uuid.uuid4().hex[:12]}"
        self.keys.add(key)
        return key

    def close(self) -> list[str]:
        for peer in self.peers:   # all three close at once (a Mooncake client takes a second to leave)
            peer.send({"op": "close"})
        self.conn.close()
        for peer in self.peers:
            peer.read()
        return self._leftovers(self)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, peers):
    name = request.param
    if name == "shared_memory":
        shm_dir = f"/dev/shm/ortest-{uuid.uuid4().hex}"
        os.mkdir(shm_dir)
        b = Backend(name, {"shm_dir": shm_dir}, lambda _: sorted(os.listdir(shm_dir)), peers)
        yield b
        left = b.close()
        shutil.rmtree(shm_dir, ignore_errors=True)
    elif name == "redis":
        server = request.getfixturevalue("redis_server")
        prefix = f"ortest-{uuid.uuid4().hex[:8]}:"

        def redis_left(_):
            return sorted(k.decode() for k in server.client().scan_iter(match=prefix + "*"))
        options = {"url": server.url, "prefix": prefix, "chunk_mb": 0.25, "pool_mb": 64}
        b = Backend(name, options, redis_left, peers)
        yield b
        left = b.close()
    elif name == "mooncake_transfer_engine":
        reason = mooncake_skip_reason()
        if reason:
            pytest.skip(reason)
        directory = f"/dev/shm/ortest-te-{uuid.uuid4().hex}"
        b = Backend(name, {"directory": directory, "pool_mb": 64}, lambda _: sorted(os.listdir(directory)),
                    peers)
        yield b
        left = b.close()
        shutil.rmtree(directory, ignore_errors=True)
    elif name == "yuanrong":
        worker = request.getfixturevalue("yuanrong_worker")
        # The 2 s default request timeout bounds how long a dead worker stalls a process (the client
        # holds the GIL); a live one on this shared host once took longer (a 7 KB put under the
        # concurrency test), and outages are tested apart (test_yuanrong_faults.py).
        options = {"address": worker.address, "prefix": f"ortest-{uuid.uuid4().hex[:8]}:", "pool_mb": 64,
                   "request_timeout_s": 10}

        b = Backend(name, options, lambda b: _still_readable(name, options, b.keys), peers)
        yield b
        left = b.close()
    else:
        master = request.getfixturevalue("mooncake_master")
        options = {"master": master.address, "segment_mb": 128, "pool_mb": 64}

        # A reader only (no segment of its own): quick to start.
        b = Backend(name, options, lambda b: _still_readable(name, {**options, "segment_mb": 0}, b.keys), peers)
        yield b
        left = b.close()
    assert left == [], f"{name} left data behind: {left}"


def assert_same(got: dict, want: dict) -> None:
    assert same_payload(got, want) == []


# ------------------------------------------------------------------------------------ tests


def test_every_backend_is_registered():
    assert set(BACKENDS) <= set(available_connectors())


def test_peer_put_then_get_with_handle_and_key_only(backend):
    producer = backend.peers[0]
    key = backend.key("kv")
    handle = producer.call({"op": "put", "key": key, "seed": 1, "big_mb": 3})["handle"]
    assert isinstance(handle, dict) and len(msgpack.packb(handle)) < 512   # travels on the bus
    assert_same(backend.conn.get(key, handle, timeout=10), make_payload(1, 3))   # handle get
    assert_same(backend.conn.get(key, timeout=10), make_payload(1, 3))           # key-only get
    backend.conn.delete(key)


def test_put_here_get_in_other_process(backend):
    key, key2 = backend.key("kv"), backend.key("kv")
    handle = backend.conn.put(key, make_payload(2, 1))
    backend.conn.put(key2, make_payload(3))
    consumer = backend.peers[1]
    assert consumer.call({"op": "get", "key": key, "handle": handle, "seed": 2, "big_mb": 1}) ["bad"] == []
    assert consumer.call({"op": "get", "key": key2, "seed": 3})["bad"] == []   # key only
    consumer.call({"op": "delete", "key": key})
    consumer.call({"op": "delete", "key": key2})
    for k, h in ((key, handle), (key2, None)):
        reply = consumer.call({"op": "get", "key": k, "handle": h, "timeout": 0.2})
        assert "TransferFailed" in reply["error"]


def test_put_copies_the_source(backend):
    key = backend.key("copy")
    source = torch.arange(1000, dtype=torch.float32)
    backend.conn.put(key, {"t": source})
    source.fill_(-1)   # the caller may reuse its tensors as soon as put returns
    reply = backend.peers[0].call({"op": "get", "key": key, "timeout": 5})
    assert "error" not in reply
    assert torch.equal(backend.conn.get(key, timeout=5)["t"], torch.arange(1000, dtype=torch.float32))
    backend.conn.delete(key)


@pytest.mark.parametrize("with_handle", [False, True], ids=["key_only", "handle"])
def test_missing_key_fails_within_the_timeout(backend, with_handle):
    key = backend.key("missing")
    handle = None
    if with_handle:   # a handle whose payload was deleted: as good as a missing key
        other = backend.key("deleted")
        handle = backend.peers[0].call({"op": "put", "key": other, "seed": 4})["handle"]
        backend.peers[0].call({"op": "delete", "key": other})
        key = other
    t0 = time.monotonic()
    with pytest.raises(TransferFailed) as info:
        backend.conn.get(key, handle, timeout=0.4)
    elapsed = time.monotonic() - t0
    # Key-only waits out the timeout (the producer may still come); with a handle the producer had
    # finished, so a backend that can tell the key is gone may fail at once (connectors/base.py).
    assert (0.0 if with_handle else 0.39) <= elapsed < 2.5, elapsed
    assert key in str(info.value)


def test_delete_is_idempotent_and_final(backend):
    key = backend.key("del")
    handle = backend.peers[0].call({"op": "put", "key": key, "seed": 5})["handle"]
    assert_same(backend.conn.get(key, handle, timeout=5), make_payload(5))
    backend.conn.delete(key)
    backend.conn.delete(key)
    backend.conn.delete(backend.key("never-put"))
    with pytest.raises(TransferFailed):
        backend.conn.get(key, handle, timeout=0.1)
    assert "TransferFailed" in backend.peers[1].call({"op": "get", "key": key, "timeout": 0.1})["error"]


def test_tensors_stay_valid_after_delete_and_put_again(backend):
    key = backend.key("valid")
    handle = backend.peers[0].call({"op": "put", "key": key, "seed": 6, "big_mb": 1})["handle"]
    got = backend.conn.get(key, handle, timeout=5)
    backend.conn.delete(key)
    backend.peers[0].call({"op": "put", "key": key, "seed": 7, "big_mb": 1})
    assert_same(backend.conn.get(key, timeout=5), make_payload(7, 1))
    assert_same(got, make_payload(6, 1))   # untouched by the delete and the new payload
    backend.conn.delete(key)


def test_put_again_replaces_the_value(backend):
    key = backend.key("again")
    backend.peers[0].call({"op": "put", "key": key, "seed": 8})
    backend.peers[0].call({"op": "put", "key": key, "seed": 9})
    assert_same(backend.conn.get(key, timeout=5), make_payload(9))
    backend.conn.delete(key)


def test_consumer_waits_for_a_later_put(backend):
    key = backend.key("late")
    result: dict = {}

    def consume():
        t0 = time.monotonic()
        try:
            result["payload"] = backend.conn.get(key, timeout=20)
        except Exception as exc:  # noqa: BLE001
            result["error"] = exc
        result["waited"] = time.monotonic() - t0

    thread = threading.Thread(target=consume)
    thread.start()
    try:
        time.sleep(0.3)
        assert not result
        backend.peers[0].call({"op": "put", "key": key, "seed": 10})
    finally:
        thread.join(30)
    assert "error" not in result, result.get("error")
    assert_same(result["payload"], make_payload(10))
    assert result["waited"] >= 0.29
    backend.conn.delete(key)


def test_concurrent_producers_and_consumers(backend):
    """Two producer processes (two threads each) while this process consumes with three threads;
    then this process produces with three threads while both peers consume with two each."""
    a, b = backend.peers
    items_a = [[backend.key("conc-a"), 100 + i] for i in range(6)]
    items_b = [[backend.key("conc-b"), 200 + i] for i in range(6)]
    for peer, items in ((a, items_a), (b, items_b)):
        peer.send({"op": "put_many", "items": items, "threads": 2})

    def consume(item):
        key, seed = item
        got = backend.conn.get(key, timeout=30)
        bad = same_payload(got, make_payload(seed))
        backend.conn.delete(key)
        return bad

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(consume, items_a + items_b))
    assert results == [[]] * 12
    assert len(a.read()["handles"]) == 6 and len(b.read()["handles"]) == 6

    mine = [[backend.key("conc-c"), 300 + i] for i in range(12)]
    a.send({"op": "get_many", "items": [[k, None, s] for k, s in mine[:6]], "threads": 2})
    b.send({"op": "get_many", "items": [[k, None, s] for k, s in mine[6:]], "threads": 2})
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda item: backend.conn.put(item[0], make_payload(item[1])), mine))
    for peer in (a, b):
        assert [bad for _, bad in peer.read()["results"]] == [[]] * 6


def test_health_is_a_small_non_blocking_map(backend):
    t0 = time.monotonic()
    health = backend.conn.health()
    assert time.monotonic() - t0 < 0.05
    assert health["backend"] == backend.name and health["ok"] is True
    msgpack.packb(health)
    peer_health = backend.peers[0].call({"op": "health"})["health"]
    assert peer_health["backend"] == backend.name


def test_close_is_idempotent(backend):
    extra = create_connector(backend.name, backend.options)
    extra.close()
    extra.close()
    assert extra.health()["ok"] is False
    with pytest.raises(TransferFailed):
        extra.put(backend.key("closed"), {"x": 1})


def test_payload_larger_than_the_pool(backend):
    """A payload bigger than the reusable buffers takes a one-off buffer instead of failing."""
    small = {**backend.options, "pool_mb": 1}
    producer, consumer = create_connector(backend.name, small), create_connector(backend.name, small)
    try:
        key = backend.key("big")
        handle = producer.put(key, make_payload(600, 4))
        assert_same(consumer.get(key, handle, timeout=10), make_payload(600, 4))
        consumer.delete(key)
    finally:
        consumer.close()
        producer.close()


# ------------------------------------------------------------------------- writing in place


def held_memory(conn) -> dict[str, int]:
    """The health counters that describe memory a connector holds: its shared memory segments
    (bytes, and how many: pending ones plus free ones), its pool's bytes in use, payloads
    published and not yet consumed, and reservations not yet published or released. Every
    backend reports at least one of them."""
    health = conn.health()
    held = {k: health[k] for k in ("segment_bytes", "segments_pending", "payloads_pending", "keys_put_pending",
                                   "pool_in_use", "reservations_open") if k in health}
    if "segments_free" in health:
        held["segments"] = health["segments_free"] + health["segments_pending"]
    assert held, f"{health['backend']} reports no held-memory counter: {sorted(health)}"
    return held


def assert_no_growth(before: dict[str, int], after: dict[str, int]) -> None:
    assert {k: (before[k], after[k]) for k in before if after[k] > before[k]} == {}


def warm_up(conn, *layouts) -> None:
    """Reserve and release each layout until the backend's pool holds what it needs: a pool may
    hand out each of its free buffers in turn (shared memory: free segments of one size, first in
    first out), growing each one once to the size asked."""
    for layout in layouts:
        for _ in range(conn.health().get("segments_free", 0) + 1):
            conn.release(conn.reserve(layout))


def reserve_filled(conn, tensors: dict[str, torch.Tensor]):
    reservation = conn.reserve({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()})
    for name, t in tensors.items():
        reservation.tensors[name].copy_(t)
    return reservation


KV_SMALL = {"kv": ((2, 64, 1024), torch.bfloat16)}                                    # 256 KiB
KV_LARGE = {"kv": ((4, 128, 1024), torch.bfloat16), "ids": ((128,), torch.int64)}     # 1 MiB


def test_reserve_lends_contiguous_writable_tensors_of_the_layout(backend):
    want = {name: value for name, value in make_payload(700).items() if isinstance(value, torch.Tensor)}
    layout = {name: (tuple(t.shape), t.dtype) for name, t in want.items()}
    reservation = backend.conn.reserve(layout)
    try:
        assert list(reservation.tensors) == list(layout)
        for name, t in reservation.tensors.items():
            assert (tuple(t.shape), t.dtype) == layout[name] and t.is_contiguous(), name
        for name, t in want.items():
            reservation.tensors[name].copy_(t)
        # Every tensor kept what was written into it: none overlaps another.
        assert same_payload(reservation.tensors, want) == []
    finally:
        backend.conn.release(reservation)
    for bad in ({"x": ((-1, 2), torch.float32)}, {"x": ((2,), "float32")}, {"x": torch.float32}):
        with pytest.raises(ValueError):
            backend.conn.reserve(bad)


def test_peer_puts_in_place_then_get_with_handle_and_key_only(backend):
    key = backend.key("inplace")
    handle = backend.peers[0].call({"op": "put_reserved", "key": key, "seed": 701, "big_mb": 3})["handle"]
    assert isinstance(handle, dict) and len(msgpack.packb(handle)) < 512
    assert_same(backend.conn.get(key, handle, timeout=10), make_payload(701, 3))
    assert_same(backend.conn.get(key, timeout=10), make_payload(701, 3))
    backend.conn.delete(key)


def test_put_in_place_here_get_in_other_process(backend):
    key = backend.key("inplace")
    handle = put_reserved(backend.conn, key, make_payload(702, 1))
    consumer = backend.peers[1]
    assert consumer.call({"op": "get", "key": key, "handle": handle, "seed": 702, "big_mb": 1})["bad"] == []
    assert consumer.call({"op": "get", "key": key, "seed": 702, "big_mb": 1})["bad"] == []   # key only
    consumer.call({"op": "delete", "key": key})
    assert "TransferFailed" in consumer.call({"op": "get", "key": key, "handle": handle, "timeout": 0.2})["error"]


@pytest.mark.parametrize("extra", [
    {"meta": {"text": "x" * 5000, "ids": list(range(500))}},   # more header than a reservation keeps room for
    {"blob": bytes(range(256)) * 8192, "ids": torch.arange(1 << 18)},   # 2 MiB + 2 MiB after the tensors
], ids=["long_header", "large_data"])
def test_put_reserved_with_extras_beyond_the_reserved_room(backend, extra):
    """A backend that cannot complete the payload where it was reserved still publishes exactly
    what ``put`` would (by copying)."""
    key = backend.key("inplace-extra")
    tensors = {"kv": torch.randn(2, 16, 64).to(torch.bfloat16), "mask": torch.arange(50) % 3 == 0}
    handle = backend.conn.put_reserved(key, reserve_filled(backend.conn, tensors), extra)
    assert_same(backend.conn.get(key, handle, timeout=5), {**tensors, **extra})
    assert_same(backend.conn.get(key, timeout=5), {**tensors, **extra})
    backend.conn.delete(key)


def test_tensors_got_stay_valid_while_the_producer_writes_in_place_again(backend):
    key = backend.key("valid-inplace")
    handle = backend.peers[0].call({"op": "put_reserved", "key": key, "seed": 704, "big_mb": 1})["handle"]
    got = backend.conn.get(key, handle, timeout=5)
    backend.conn.delete(key)
    for seed in (705, 706, 707):   # the producer reserves again, and again, while `got` is held
        handle = backend.peers[0].call({"op": "put_reserved", "key": key, "seed": seed, "big_mb": 1})["handle"]
        assert_same(backend.conn.get(key, handle, timeout=5), make_payload(seed, 1))
        backend.conn.delete(key)
    assert_same(got, make_payload(704, 1))


@pytest.mark.parametrize("extra", [{"kv": 1}, {"ok": 1, "bad": object()}], ids=["name_clash", "not_msgpack"])
def test_put_reserved_that_fails_releases_the_reservation(backend, extra):
    tensors = {"kv": torch.arange(4096, dtype=torch.float32)}
    warm_up(backend.conn, {"kv": ((4096,), torch.float32)})
    before = held_memory(backend.conn)
    key = backend.key("clash")
    reservation = reserve_filled(backend.conn, tensors)
    with pytest.raises(ValueError):
        backend.conn.put_reserved(key, reservation, extra)
    with pytest.raises(ValueError):   # put_reserved released it: it cannot be published now
        backend.conn.put_reserved(key, reservation, {"ok": 1})
    backend.conn.release(reservation)   # idempotent
    assert_no_growth(before, held_memory(backend.conn))
    with pytest.raises(TransferFailed):
        backend.conn.get(key, timeout=0)


def test_a_reservation_is_used_once(backend):
    key, again, after_release = backend.key("once"), backend.key("once-again"), backend.key("once-released")
    want = {"kv": torch.arange(1000, dtype=torch.int32).reshape(10, 100), "n": 7}
    reservation = reserve_filled(backend.conn, {"kv": want["kv"]})
    handle = backend.conn.put_reserved(key, reservation, {"n": 7})
    with pytest.raises(ValueError):
        backend.conn.put_reserved(again, reservation, {"n": 8})
    backend.conn.release(reservation)   # after a publish: a no-op
    with pytest.raises(ValueError):
        backend.conn.put_reserved(again, reservation)
    assert_same(backend.conn.get(key, handle, timeout=5), want)   # the publish stands

    released = reserve_filled(backend.conn, {"kv": want["kv"]})
    backend.conn.release(released)
    backend.conn.release(released)
    with pytest.raises(ValueError):
        backend.conn.put_reserved(after_release, released, {"n": 7})
    for k in (again, after_release):
        with pytest.raises(TransferFailed):
            backend.conn.get(k, timeout=0)
    backend.conn.delete(key)


def test_ordinary_tensors_reserved_elsewhere_are_published_by_copy(backend):
    """A reservation of ordinary tensors (the base class's, as a wrapper or another connector lends
    them) goes through any backend's put_reserved and release: copied, never mistaken for its own."""
    key = backend.key("foreign")
    want = {"kv": torch.arange(600, dtype=torch.float32).reshape(6, 100), "n": 3}
    reservation = Connector.reserve(backend.conn, {"kv": ((6, 100), torch.float32)})
    reservation.tensors["kv"].copy_(want["kv"])
    handle = backend.conn.put_reserved(key, reservation, {"n": 3})
    assert reservation.done and reservation.tensors == {}
    assert_same(backend.conn.get(key, handle, timeout=5), want)
    backend.conn.delete(key)
    unused = Connector.reserve(backend.conn, {"kv": ((2, 2), torch.int8)})
    backend.conn.release(unused)
    assert unused.done


def test_reserve_and_release_in_a_loop_holds_no_more_memory(backend):
    conn = backend.conn
    warm_up(conn, KV_SMALL, KV_LARGE)
    before = held_memory(conn)
    for i in range(200):
        reservation = conn.reserve(KV_SMALL if i % 2 else KV_LARGE)
        reservation.tensors["kv"][0, 0].fill_(i)
        conn.release(reservation)
    assert_no_growth(before, held_memory(conn))
    # The memory given back serves the next publish.
    key = backend.key("after-loop")
    want = {"kv": torch.full((4, 128, 1024), 3.0, dtype=torch.bfloat16), "ids": torch.arange(128)}
    handle = conn.put_reserved(key, reserve_filled(conn, want))
    assert backend.peers[0].call({"op": "get", "key": key, "handle": handle, "timeout": 5}).get("error") is None
    assert_same(conn.get(key, handle, timeout=5), want)
    conn.delete(key)


def test_reservation_larger_than_the_pool(backend):
    """A reservation bigger than the reusable buffers takes a one-off buffer instead of failing,
    and gives it back when released."""
    small = {**backend.options, "pool_mb": 1}
    producer, consumer = create_connector(backend.name, small), create_connector(backend.name, small)
    try:
        key = backend.key("big-inplace")
        handle = put_reserved(producer, key, make_payload(703, 4))
        assert_same(consumer.get(key, handle, timeout=10), make_payload(703, 4))
        assert_same(consumer.get(key, timeout=10), make_payload(703, 4))
        consumer.delete(key)
        big = {"big": (((3 << 20) // 4,), torch.int32)}   # 3 MiB
        warm_up(producer, big)
        before = held_memory(producer)
        for _ in range(3):
            producer.release(producer.reserve(big))
        assert_no_growth(before, held_memory(producer))
    finally:
        consumer.close()
        producer.close()
