"""Fault injection for the connectors: a producer or consumer killed with SIGKILL, and a Redis
server that goes away mid-way and comes back.

* shared memory: nothing of a dead owner survives the next connector's start (segments, key
  entries, owner file); a consumer's tensors stay valid after its producer died; a consumer that
  dies releases its lease so the producer can recycle the segment.
* redis: every key of a transfer abandoned mid-way (producer killed between chunks) expires by TTL.
* redis outage: a clear ``TransferFailed`` naming the server, quickly; the same connector works
  again once the server is back, and a ``get`` that was waiting rides the outage out.
* mooncake transfer engine: a dead producer gives ``TransferFailed`` within the timeout and its
  directory entries are swept.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid

import pytest
import torch

from connector_peer import make_payload, same_payload
from connector_servers import Peer, started_redis
from omnirelay.connectors import create_connector
from omnirelay.connectors.shared_memory import SharedMemoryConnector, sweep_orphans
from omnirelay.errors import TransferFailed

pytestmark = pytest.mark.timeout(120)


def owned_by(directory: str, pid: int) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(f"omnirelay-{pid}-"))


# ------------------------------------------------------------------------------ shared memory


def test_shm_kill_9_producer_leaves_nothing_after_the_next_start(shm_dir):
    peer = Peer("shared_memory", {"shm_dir": shm_dir})
    try:
        peer.wait_ready()
        handles = [peer.call({"op": "put", "key": f"orphan/{i}", "seed": i, "big_mb": 2 * i})["handle"]
                   for i in range(3)]
        consumer = SharedMemoryConnector({"shm_dir": shm_dir})
        held = consumer.get("orphan/2", handles[2], timeout=5)   # a live consumer maps one of them
        assert len(owned_by(shm_dir, peer.pid)) == 7               # 3 entries, 3 segments, owner file
        peer.kill9()
        assert len(owned_by(shm_dir, peer.pid)) == 7               # a crash leaves its files …
        restarted = SharedMemoryConnector({"shm_dir": shm_dir})    # … until the next connector starts
        assert owned_by(shm_dir, peer.pid) == []
        assert sweep_orphans(shm_dir) == 0
        assert same_payload(held, make_payload(2, 4)) == []        # the consumer's tensors survive
        with pytest.raises(TransferFailed):
            consumer.get("orphan/0", timeout=0.05)
        restarted.close()
        consumer.close()
    finally:
        peer.close()


def test_shm_kill_9_consumer_releases_its_lease(shm_dir):
    producer = SharedMemoryConnector({"shm_dir": shm_dir})
    peer = Peer("shared_memory", {"shm_dir": shm_dir})
    try:
        peer.wait_ready()
        first = producer.put("held", make_payload(1, 4))
        peer.call({"op": "get_hold", "key": "held", "handle": first})   # the peer keeps the tensors
        peer.call({"op": "delete", "key": "held"})
        # The peer still maps the segment: a new payload must not overwrite it.
        second = producer.put("next", make_payload(2, 4))
        assert second["segment"] != first["segment"]
        producer.delete("next")
        peer.kill9()   # the dead consumer's lease goes with its descriptors
        third = producer.put("again", make_payload(3, 4))
        assert third["segment"] in (first["segment"], second["segment"])
        assert producer.health()["segments_free"] + producer.health()["segments_pending"] == 2
        assert same_payload(producer.get("again", third, timeout=1), make_payload(3, 4)) == []
        producer.delete("again")
    finally:
        peer.close()
        producer.close()


# -------------------------------------------------------------------------------------- redis


@pytest.fixture
def redis_server(tmp_path):
    server = started_redis(tmp_path)
    yield server
    server.stop()


def test_redis_keys_of_an_abandoned_transfer_expire(redis_server):
    prefix = f"ortest-{uuid.uuid4().hex[:8]}:"
    options = {"url": redis_server.url, "prefix": prefix, "ttl_s": 1.0, "chunk_mb": 0.25}
    peer = Peer("redis", options)
    client = redis_server.client()
    try:
        peer.wait_ready()
        peer.send({"op": "put_forever", "key": "abandoned", "big_mb": 1.5})
        deadline = time.monotonic() + 30
        while len(list(client.scan_iter(match=prefix + "*"))) < 12 and time.monotonic() < deadline:
            time.sleep(0.02)
        peer.kill9()   # most likely between two chunks of a payload
        left = list(client.scan_iter(match=prefix + "*"))
        assert len(left) >= 12, "the producer never got going"
        assert all(0 < client.pttl(k) <= 1000 for k in left)   # every key carries the TTL
        deadline = time.monotonic() + 5
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = list(client.scan_iter(match=prefix + "*"))
        assert left == []
    finally:
        peer.close()


def test_redis_outage_gives_a_clear_error_and_the_connector_recovers(redis_server):
    options = {"url": redis_server.url, "prefix": f"ortest-{uuid.uuid4().hex[:8]}:", "connect_timeout_s": 1.0,
               "socket_timeout_s": 2.0}
    conn = create_connector("redis", options)
    try:
        conn.put("before", {"t": torch.arange(10)})
        assert torch.equal(conn.get("before", timeout=1)["t"], torch.arange(10))

        redis_server.stop()   # SIGTERM to the PID we started
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match=f"redis at 127.0.0.1:{redis_server.port} unreachable"):
            conn.put("during", {"t": torch.ones(3)})
        with pytest.raises(TransferFailed, match="unreachable"):
            conn.get("before", timeout=0.5)
        with pytest.raises(TransferFailed, match="unreachable"):
            conn.delete("before")
        assert time.monotonic() - t0 < 6
        health = conn.health()
        assert health["ok"] is False and "unreachable" in health["last_error"]

        # A consumer that is already waiting rides out the outage.
        result: dict = {}
        waiter = threading.Thread(target=lambda: result.update(payload=conn.get("after", timeout=20)))
        waiter.start()
        time.sleep(0.3)
        redis_server.start()   # same port, empty: Redis without persistence lost "before"
        conn.put("after", {"t": torch.arange(5)})
        waiter.join(25)
        assert torch.equal(result["payload"]["t"], torch.arange(5))
        assert conn.health()["ok"] is True
        conn.delete("after")
        with pytest.raises(TransferFailed, match="not available"):
            conn.get("before", timeout=0.1)
    finally:
        conn.close()


def test_redis_key_lost_by_a_restart_fails_a_handle_get_at_once(redis_server):
    """A handle says the producer had finished; when Redis comes back empty the consumer must not
    wait out its timeout (a decode worker blocked there stalls every stream it serves)."""
    options = {"url": redis_server.url, "prefix": f"ortest-{uuid.uuid4().hex[:8]}:", "connect_timeout_s": 1.0,
               "socket_timeout_s": 2.0}
    conn = create_connector("redis", options)
    try:
        handle = conn.put("kv", {"t": torch.arange(10)})
        redis_server.stop()
        redis_server.start()   # same port, empty
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match="is gone"):
            conn.get("kv", handle, timeout=20)
        assert time.monotonic() - t0 < 3
        with pytest.raises(TransferFailed, match="not available within 0.3s"):   # key-only still waits
            conn.get("kv", timeout=0.3)
    finally:
        conn.close()


# ------------------------------------------------------------------------- mooncake transfer engine


def test_mooncake_te_dead_producer_fails_within_timeout(tmp_path):
    pytest.importorskip("mooncake.engine", reason="mooncake not installed (pip install 'omnirelay[mooncake]')")
    directory = f"/dev/shm/ortest-te-{uuid.uuid4().hex}"
    options = {"directory": directory, "pool_mb": 32}
    peer = Peer("mooncake_transfer_engine", options)
    try:
        peer.wait_ready()
        handle = peer.call({"op": "put", "key": "gone", "seed": 1})["handle"]
        peer.kill9()
        assert len(os.listdir(directory)) == 1
        conn = create_connector("mooncake_transfer_engine", options)   # sweeps the dead producer's entry
        try:
            assert os.listdir(directory) == []
            t0 = time.monotonic()
            with pytest.raises(TransferFailed, match="gone"):
                conn.get("gone", handle, timeout=1.0)
            assert time.monotonic() - t0 < 5
        finally:
            conn.close()
    finally:
        peer.close()
        shutil.rmtree(directory, ignore_errors=True)
