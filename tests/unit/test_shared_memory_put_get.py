"""The ``shared_memory`` connector within one process: put, get and delete, key-only gets from another
connector object, zero-copy reads, a consumer waiting for a later put, threads sharing a connector,
and handles, keys or segments that are missing, crafted or corrupt."""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid

import msgpack
import pytest
import torch

from omnirelay.connectors import create_connector
from omnirelay.connectors.shared_memory import PREFIX, SharedMemoryConnector
from omnirelay.errors import TransferFailed

from shm_support import (assert_same, conn, files, keys_in, no_segments_in_real_dev_shm,  # noqa: F401  (fixtures)
                         segments_in, shm_child, small_payload)


def test_put_get_delete(conn, shm_dir):
    payload = shm_child.make_payload(3)
    handle = conn.put("req-1/kv", payload)
    assert isinstance(handle, dict)
    msgpack.packb(handle)  # handles travel on the bus
    assert len(handle["segment"]) < 100 and "/" not in handle["segment"]
    assert segments_in(shm_dir) == [handle["segment"]] and len(keys_in(shm_dir)) == 1
    assert handle["segment"].startswith(f"{PREFIX}{os.getpid()}-")

    assert_same(conn.get("req-1/kv", handle, timeout=1), payload)  # with handle
    assert_same(conn.get("req-1/kv", timeout=1), payload)          # key only
    conn.delete("req-1/kv")
    assert keys_in(shm_dir) == []                                  # the segment stays, for reuse
    with pytest.raises(TransferFailed):
        conn.get("req-1/kv", timeout=0.05)
    with pytest.raises(TransferFailed):
        conn.get("req-1/kv", handle, timeout=0.05)


def test_key_only_get_from_another_connector_object(shm_dir):
    producer = SharedMemoryConnector({"shm_dir": shm_dir})
    consumer = create_connector("shared_memory", {"shm_dir": shm_dir})
    try:
        producer.put("k", small_payload(1))
        assert_same(consumer.get("k", timeout=1), small_payload(1))
        consumer.delete("k")
        assert keys_in(shm_dir) == []
    finally:
        producer.close()
        consumer.close()
    assert files(shm_dir) == []   # close removed the free segment and the owner file


def test_many_keys_are_independent(conn, shm_dir):
    handles = {f"key-{i}": conn.put(f"key-{i}", small_payload(i)) for i in range(20)}
    assert len(keys_in(shm_dir)) == 20 and len(segments_in(shm_dir)) == 20
    for i in reversed(range(20)):
        assert_same(conn.get(f"key-{i}", handles[f"key-{i}"], timeout=1), small_payload(i))
        conn.delete(f"key-{i}")
    assert keys_in(shm_dir) == []
    conn.put("again", small_payload(0))   # reuses a free segment
    assert len(segments_in(shm_dir)) == 20
    conn.delete("again")


def test_put_again_replaces_value(conn, shm_dir):
    first = conn.put("k", small_payload(1))
    second = conn.put("k", small_payload(2))
    assert len(keys_in(shm_dir)) == 1
    assert_same(conn.get("k", timeout=1), small_payload(2))
    assert_same(conn.get("k", first, timeout=1), small_payload(2))   # a stale handle finds the key anew
    assert conn.health()["segments_free"] == 1 and second["segment"] != first["segment"]
    conn.delete("k")


def test_put_copies_source(conn):
    t = torch.arange(6.0)
    conn.put("k", {"t": t})
    t.fill_(-1)  # the caller may reuse its tensors as soon as put returns
    assert torch.equal(conn.get("k", timeout=1)["t"], torch.arange(6.0))
    conn.delete("k")


def test_get_is_zero_copy_and_copy_on_write(conn):
    payload = {"a": torch.arange(1000, dtype=torch.int64), "b": torch.ones(64, dtype=torch.float32)}
    handle = conn.put("k", payload)
    out = conn.get("k", handle, timeout=1)
    # Both tensors are views into one mapping: their distance is exactly the offset difference.
    from omnirelay.connectors import codec
    with open(os.path.join(conn.shm_dir, handle["segment"]), "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    offsets = {e["n"]: e["o"] for e in msgpack.unpackb(raw[8: 8 + n])["entries"]}
    assert out["b"].data_ptr() - out["a"].data_ptr() == offsets["b"] - offsets["a"]
    assert out["a"].data_ptr() % codec.ALIGN == 0
    # Writing into a got tensor is private to this consumer (MAP_PRIVATE): the segment is unchanged.
    out["a"].fill_(-5)
    assert torch.equal(conn.get("k", handle, timeout=1)["a"], torch.arange(1000, dtype=torch.int64))
    conn.delete("k")


def test_get_before_put_times_out(conn):
    t0 = time.monotonic()
    with pytest.raises(TransferFailed):
        conn.get("never", timeout=0.15)
    elapsed = time.monotonic() - t0
    assert 0.14 <= elapsed < 2.0
    with pytest.raises(TransferFailed):
        conn.get("never", {"segment": f"{PREFIX}{os.getpid()}-deadbeef"}, timeout=0)


def test_handle_cannot_escape_shm_dir(conn, shm_dir):
    """A handle names a segment, not a path: a crafted '../' handle must not read outside shm_dir."""
    other = f"/dev/shm/ortest-{uuid.uuid4().hex}"
    os.mkdir(other)
    try:
        outsider = SharedMemoryConnector({"shm_dir": other})
        handle = outsider.put("k", small_payload(9))
        assert handle["segment"] in files(other)
        rel = {"segment": f"../{os.path.basename(other)}/{handle['segment']}"}
        absolute = {"segment": os.path.join(other, handle["segment"])}
        for bad in (rel, absolute, {"segment": "/etc/passwd"}, {"segment": 5}, {}):
            with pytest.raises(TransferFailed):
                conn.get("k", bad, timeout=0.02)
        outsider.delete("k")
        outsider.close()
    finally:
        shutil.rmtree(other)


def test_waiting_consumer_receives_later_put(shm_dir):
    producer = SharedMemoryConnector({"shm_dir": shm_dir})
    consumer = SharedMemoryConnector({"shm_dir": shm_dir})
    result = {}

    def consume():
        t0 = time.monotonic()
        try:
            result["payload"] = consumer.get("late", timeout=10)
        except Exception as exc:  # noqa: BLE001
            result["error"] = exc
        result["waited"] = time.monotonic() - t0

    thread = threading.Thread(target=consume)
    thread.start()
    time.sleep(0.2)
    assert "payload" not in result
    producer.put("late", small_payload(7))
    thread.join(timeout=10)
    try:
        assert not thread.is_alive()
        assert "error" not in result, result.get("error")
        assert_same(result["payload"], small_payload(7))
        assert 0.19 <= result["waited"] < 2.0
    finally:
        consumer.delete("late")
        producer.close()
        consumer.close()


def test_concurrent_threads(conn, shm_dir):
    errors = []

    def worker(w):
        try:
            for i in range(15):
                key = f"w{w}-{i}"
                h = conn.put(key, small_payload(i))
                assert_same(conn.get(key, h, timeout=2), small_payload(i))
                conn.put("shared", {"w": w})  # same key from every thread at once
                conn.delete(key)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert conn.get("shared", timeout=1)["w"] in range(4)
    conn.delete("shared")
    assert keys_in(shm_dir) == []


def test_delete_missing_key_is_fine(conn):
    conn.delete("never-existed")
    conn.put("k", small_payload())
    conn.delete("k")
    conn.delete("k")


def test_corrupt_segment_raises_transfer_failed(conn, shm_dir):
    handle = conn.put("k", small_payload())
    path = os.path.join(shm_dir, handle["segment"])
    with open(path, "r+b") as f:
        f.write(b"\xff" * 8)  # absurd header length
    with pytest.raises(TransferFailed):
        conn.get("k", handle, timeout=0.05)
    with open(path, "r+b") as f:
        f.truncate(20)
    with pytest.raises(TransferFailed):
        conn.get("k", handle, timeout=0.05)
    conn.delete("k")


def test_empty_segment_raises_transfer_failed(conn, shm_dir):
    handle = conn.put("k", small_payload())
    try:
        os.truncate(os.path.join(shm_dir, handle["segment"]), 0)
        with pytest.raises(TransferFailed):
            conn.get("k", handle, timeout=0.05)
    finally:
        conn.delete("k")
