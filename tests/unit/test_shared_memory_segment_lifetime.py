"""How long the ``shared_memory`` connector's segments live: pooled reuse, the lease a got tensor holds,
a consumer's cached mappings, close (what it removes and what it keeps for a consumer), TTL reaping
of payloads nobody consumed, and the health counters that report all of it."""

from __future__ import annotations

import json
import os
import threading
import time

import msgpack
import pytest
import torch

from omnirelay.connectors.shared_memory import SharedMemoryConnector
from omnirelay.errors import TransferFailed

from shm_support import (assert_same, conn, files, keys_in, no_segments_in_real_dev_shm,  # noqa: F401  (fixtures)
                         segments_in, shm_child, small_payload)


def test_tensors_stay_valid_after_delete_and_replace(conn, shm_dir):
    conn.put("k", {"t": torch.arange(4096, dtype=torch.float64)})
    got = conn.get("k", timeout=1)["t"]   # a lease on the segment while `got` lives
    conn.delete("k")
    assert keys_in(shm_dir) == []
    conn.put("k", {"t": torch.zeros(4096, dtype=torch.float64)})  # must not reuse the leased segment
    assert torch.equal(got, torch.arange(4096, dtype=torch.float64))
    assert len(segments_in(shm_dir)) == 2
    del got
    conn.delete("k")
    conn.put("k2", {"t": torch.ones(4096, dtype=torch.float64)})  # lease gone: a segment is reused
    assert len(segments_in(shm_dir)) == 2
    conn.delete("k2")


def test_consumer_keeps_pooled_segment_mapped_without_leaking_private_writes(shm_dir):
    """A consumer reads a reused segment through the mapping it kept (no new mmap), and a page it
    wrote into last time (a private copy) shows the producer's new payload, not the old write."""
    producer = SharedMemoryConnector({"shm_dir": shm_dir})
    consumer = SharedMemoryConnector({"shm_dir": shm_dir})
    try:
        first = producer.put("a", {"t": torch.zeros(300_000, dtype=torch.int32)})
        got = consumer.get("a", first, timeout=1)["t"]
        address = got.data_ptr()
        got[::1024].fill_(-7)   # private copies of every page
        del got
        consumer.delete("a")
        second = producer.put("b", {"t": torch.arange(300_000, dtype=torch.int32)})
        assert second["segment"] == first["segment"]   # the producer reused its segment
        got = consumer.get("b", second, timeout=1)["t"]
        assert got.data_ptr() == address               # through the same mapping
        assert consumer.health()["mappings_cached"] == 1
        assert torch.equal(got, torch.arange(300_000, dtype=torch.int32))
        # While `got` is alive, a second get of the key may not share its (writable) pages.
        got.fill_(5)
        again = consumer.get("b", second, timeout=1)["t"]
        assert again.data_ptr() != got.data_ptr()
        assert torch.equal(again, torch.arange(300_000, dtype=torch.int32))
        del got, again
        consumer.delete("b")
    finally:
        producer.close()
        consumer.close()
    assert consumer.health()["mappings_cached"] == 0


def test_consumer_unmaps_segments_its_producer_removed(shm_dir):
    producer = SharedMemoryConnector({"shm_dir": shm_dir})
    consumer = SharedMemoryConnector({"shm_dir": shm_dir})
    try:
        handle = producer.put("k", small_payload(1))
        assert_same(consumer.get("k", handle, timeout=1), small_payload(1))
        assert consumer.health()["mappings_cached"] == 1
        producer.close()             # the payload outlives its producer's connector...
        consumer.delete("k")         # ...until its consumer deletes it: segment unlinked, and unmapped
        assert consumer.health()["mappings_cached"] == 0
        assert files(shm_dir) == []
    finally:
        producer.close()
        consumer.close()


def test_many_pending_payloads_keep_put_cheap(conn, shm_dir, monkeypatch):
    """With n payloads awaiting consumers, a put must not check all n key entries (that made a
    burst of n puts cost O(n²) syscalls); consumed segments are still reclaimed."""
    for i in range(200):
        conn.put(f"pending-{i}", small_payload(i))
    calls = []
    real_readlink = os.readlink
    monkeypatch.setattr(os, "readlink", lambda path: calls.append(path) or real_readlink(path))
    for i in range(50):
        conn.delete(f"pending-{i}")
        conn.put(f"more-{i}", small_payload(i))
    monkeypatch.undo()
    assert len(calls) <= 50 * 8 + 250, len(calls)   # amortised: ≤ ~8 entry checks per put
    assert len(segments_in(shm_dir)) < 250           # and consumed segments were reused
    for i in range(50, 200):
        conn.delete(f"pending-{i}")
    for i in range(50):
        conn.delete(f"more-{i}")


def test_close_twice_and_context_manager(shm_dir):
    c = SharedMemoryConnector({"shm_dir": shm_dir})
    c.close()
    c.close()
    assert c.health()["ok"] is False
    with SharedMemoryConnector({"shm_dir": shm_dir}) as c2:
        assert c2.health()["ok"] is True
    assert c2.health()["ok"] is False
    c2.close()


def test_close_keeps_segments_awaiting_their_consumer(shm_dir):
    producer = SharedMemoryConnector({"shm_dir": shm_dir})
    producer.put("pending", small_payload())
    producer.close()
    consumer = SharedMemoryConnector({"shm_dir": shm_dir})
    assert_same(consumer.get("pending", timeout=1), small_payload())
    consumer.delete("pending")
    consumer.close()


def test_health_counters(conn):
    h0 = conn.health()
    assert h0["backend"] == "shared_memory" and h0["ok"] is True
    assert h0.get("bytes_put", 0) == 0 and h0.get("bytes_got", 0) == 0
    handle = conn.put("k", shm_child.make_payload(4))
    h1 = conn.health()
    assert h1["bytes_put"] == handle["size"] > 1_000_000
    assert h1["puts"] == 1 and h1["segments_pending"] == 1
    conn.get("k", handle, timeout=1)
    conn.get("k", timeout=1)
    h2 = conn.health()
    assert h2["bytes_got"] == 2 * handle["size"] and h2["gets"] == 2
    conn.delete("k")
    h3 = conn.health()
    assert h3["deletes"] == 1 and h3["segments_pending"] == 0
    msgpack.packb(h3)
    json.dumps(h3)


def test_health_does_not_block_while_put_runs(conn, monkeypatch):
    """health() must answer while a put is stuck in the middle of writing its segment."""
    from omnirelay.connectors import codec
    in_write, release = threading.Event(), threading.Event()
    real_write_into = codec.write_into

    def slow_write_into(buf, encode_plan):
        in_write.set()
        assert release.wait(10)
        real_write_into(buf, encode_plan)

    monkeypatch.setattr(codec, "write_into", slow_write_into)
    thread = threading.Thread(target=conn.put, args=("slow", small_payload()))
    thread.start()
    try:
        assert in_write.wait(10)
        answers = []
        probe = threading.Thread(target=lambda: answers.append(conn.health()))
        probe.start()
        probe.join(timeout=2)
        assert answers and answers[0]["ok"] is True
    finally:
        release.set()
        thread.join(timeout=10)
        conn.delete("slow")


# ------------------------------------------------------------------------------------------- TTL


def test_ttl_reaps_unconsumed_segment_on_later_put(shm_dir):
    c = SharedMemoryConnector({"shm_dir": shm_dir, "ttl_s": 0.2})
    try:
        c.put("stale", small_payload(1))
        c.put("fresh-1", small_payload(2))
        assert len(keys_in(shm_dir)) == 2
        time.sleep(0.3)
        c.put("fresh-2", small_payload(3))  # reaping happens here
        assert len(keys_in(shm_dir)) == 1
        assert len(segments_in(shm_dir)) == 2   # fresh-2 reused a reaped segment
        assert c.health()["expired"] == 2
        with pytest.raises(TransferFailed):
            c.get("stale", timeout=0.02)
        assert_same(c.get("fresh-2", timeout=1), small_payload(3))
    finally:
        for k in ("stale", "fresh-1", "fresh-2"):
            c.delete(k)
        c.close()


def test_ttl_does_not_reap_young_segments(shm_dir):
    c = SharedMemoryConnector({"shm_dir": shm_dir, "ttl_s": 30})
    try:
        for i in range(5):
            c.put(f"k{i}", small_payload(i))
        assert len(keys_in(shm_dir)) == 5
        assert c.health().get("expired", 0) == 0
    finally:
        for i in range(5):
            c.delete(f"k{i}")
        c.close()


def test_ttl_after_consumer_in_other_connector_deleted(shm_dir):
    producer = SharedMemoryConnector({"shm_dir": shm_dir, "ttl_s": 0.1})
    consumer = SharedMemoryConnector({"shm_dir": shm_dir})
    try:
        producer.put("k", small_payload())
        consumer.get("k", timeout=1)
        consumer.delete("k")
        time.sleep(0.15)
        producer.put("k2", small_payload())  # reaping the already-deleted path must not fail
        assert producer.health()["segments_pending"] == 1
    finally:
        producer.delete("k2")
        producer.close()
        consumer.close()


def test_close_reaps_expired(shm_dir):
    c = SharedMemoryConnector({"shm_dir": shm_dir, "ttl_s": 0.1})
    c.put("k", small_payload())
    time.sleep(0.15)
    c.close()
    assert files(shm_dir) == []


def test_ttl_reaps_after_a_key_is_put_again(shm_dir):
    c = SharedMemoryConnector({"shm_dir": shm_dir, "ttl_s": 0.4})
    try:
        c.put("a", small_payload(1))
        c.put("b", small_payload(2))
        time.sleep(0.25)
        c.put("a", small_payload(3))  # "a" is young again; "b" keeps ageing
        time.sleep(0.25)
        c.put("c", small_payload(4))  # "b" is 0.5 s old > ttl: must be reaped here
        with pytest.raises(TransferFailed):
            c.get("b", timeout=0.02)
    finally:
        for k in ("a", "b", "c"):
            c.delete(k)
        c.close()
