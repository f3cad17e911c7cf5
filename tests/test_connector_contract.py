"""One contract suite, run against every connector backend.

Producer and consumer sit in different processes: this test process is one side, long-lived
peers (``tests/connector_peer.py``) are the other. Redis and the Mooncake master are real servers
started on free ports of 127.0.0.1 by the fixtures below and stopped by PID. Each backend's
section ends by checking it left nothing behind: no shared memory file, Redis key, directory entry
or Mooncake object.

A backend whose library or server cannot run here is skipped with the precise reason.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import os
import shutil
import threading
import time
import uuid

import msgpack
import pytest
import torch

from connector_peer import make_payload, same_payload
from connector_servers import MooncakeMaster, Peer, RedisServer
from omnirelay.connectors import available_connectors, create_connector
from omnirelay.connectors.chunked import ChunkedConsumer, ChunkedProducer, StreamState, chunk_key, read_all
from omnirelay.errors import TransferFailed

BACKENDS = ["shared_memory", "redis", "mooncake_transfer_engine", "mooncake_store"]

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"redis backend unavailable: redis-py not installed ({exc}); pip install 'omnirelay[redis]'")
    try:
        server = RedisServer(tmp_path_factory.mktemp("redis"))
        server.start()
    except (FileNotFoundError, RuntimeError) as exc:
        pytest.skip(f"redis backend unavailable: {exc}")
    yield server
    server.stop()


def _mooncake_skip_reason() -> str | None:
    try:
        importlib.import_module("mooncake.engine")
        importlib.import_module("mooncake.store")
    except ImportError as exc:
        return f"mooncake unavailable: import failed: {exc} (pip install 'omnirelay[mooncake]'; Debian libibverbs1)"
    except OSError as exc:
        return f"mooncake unavailable: shared library failed to load: {exc} (Debian: apt-get install libibverbs1)"
    return None


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    reason = _mooncake_skip_reason()
    if reason:
        pytest.skip(reason)
    try:
        master = MooncakeMaster(tmp_path_factory.mktemp("mooncake"))
        master.start()
    except (FileNotFoundError, RuntimeError) as exc:
        pytest.skip(f"mooncake_store unavailable: mooncake_master failed to start: {exc}")
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
        reason = _mooncake_skip_reason()
        if reason:
            pytest.skip(reason)
        directory = f"/dev/shm/ortest-te-{uuid.uuid4().hex}"
        b = Backend(name, {"directory": directory, "pool_mb": 64}, lambda _: sorted(os.listdir(directory)),
                    peers)
        yield b
        left = b.close()
        shutil.rmtree(directory, ignore_errors=True)
    else:
        master = request.getfixturevalue("mooncake_master")
        options = {"master": master.address, "segment_mb": 128, "pool_mb": 64}

        def store_left(b):
            probe = create_connector(name, {**options, "segment_mb": 0})   # a reader only: quick to start
            try:
                left = []
                for key in sorted(b.keys):
                    for k in (key, *(chunk_key(key, i) for i in range(12))):
                        try:
                            probe.get(k, timeout=0)
                            left.append(k)
                        except TransferFailed:
                            pass
                return left
            finally:
                probe.close()
        b = Backend(name, options, store_left, peers)
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


# ---------------------------------------------------------------------------- chunked streams


def test_chunked_consumer_starts_before_the_last_chunk_is_written(backend):
    producer = backend.peers[0]
    key = backend.key("stream")
    producer.call({"op": "stream_open", "key": key, "seed": 400})   # chunk 0 only
    consumer = ChunkedConsumer(backend.conn, key, timeout=20)
    chunks = iter(consumer)
    assert_same(next(chunks), make_payload(400))   # received while chunks 1..4 do not exist yet
    assert consumer.state is StreamState.OPEN
    producer.send({"op": "stream_rest", "key": key, "seed": 400, "n": 5})
    rest = list(chunks)
    assert producer.read()["written"] == 5
    assert [same_payload(c, make_payload(400 + i)) for i, c in enumerate(rest, 1)] == [[]] * 4
    assert consumer.state is StreamState.FINISHED and consumer.received == 5


def test_chunked_stream_from_this_process(backend):
    key = backend.key("stream")
    with ChunkedProducer(backend.conn, key) as stream:
        for i in range(3):
            stream.put({"layer": torch.full((4, 8), float(i)), "i": i})
    assert stream.state is StreamState.FINISHED
    got = read_all(backend.conn, key, timeout=10)
    assert [c["i"] for c in got] == [0, 1, 2]
    assert all(torch.equal(c["layer"], torch.full((4, 8), float(c["i"]))) for c in got)


def test_chunked_abort_reaches_the_consumer(backend):
    producer = backend.peers[1]
    key = backend.key("stream")
    producer.call({"op": "stream_open", "key": key, "seed": 500})
    producer.call({"op": "stream_rest", "key": key, "seed": 500, "n": 2, "abort": "prefill worker lost its GPU"})
    consumer = ChunkedConsumer(backend.conn, key, timeout=10)
    received = []
    with pytest.raises(TransferFailed, match="lost its GPU"):
        for chunk in consumer:
            received.append(chunk)
    assert len(received) == 2 and consumer.state is StreamState.ABORTED


def test_chunked_stalled_producer_times_out(backend):
    key = backend.key("stream")
    stream = ChunkedProducer(backend.conn, key)
    stream.put({"x": 1})
    consumer = ChunkedConsumer(backend.conn, key, timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="chunk 1"):
        list(consumer)
    assert time.monotonic() - t0 < 3
    stream.finish()
    backend.conn.delete(chunk_key(key, 1))   # the end marker nobody read


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
