"""Tests for the ``shared_memory`` connector and the connector registry.

Every test works in a private directory ``/dev/shm/ortest-<uuid>/`` (never in /dev/shm itself, whose
``omnirelay-*`` segments may belong to other processes) and must leave it empty.

Layout (see the module): one key entry (a symlink ``omnirelay-<pid>-<key hash>``) per published key,
pooled segments ``omnirelay-<pid>-c<n>-s<m>`` that a producer reuses, and its owner file
``omnirelay-<pid>-c<n>-owner`` while its connector is open.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import pathlib
import re
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import msgpack
import pytest
import torch

from omnirelay.connectors import available_connectors, create_connector, register_connector, registry
from omnirelay.connectors.base import Connector
from omnirelay.connectors.shared_memory import PREFIX, SharedMemoryConnector, sweep_orphans
from omnirelay.errors import TransferFailed

HERE = pathlib.Path(__file__).resolve().parent
CHILD = HERE / "shm_child.py"

_spec = importlib.util.spec_from_file_location("_omnirelay_shm_child", CHILD)
shm_child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shm_child)


# --------------------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def _no_segments_in_real_dev_shm():
    """Nothing this process does may land in the real /dev/shm."""
    pattern = f"/dev/shm/{PREFIX}{os.getpid()}-*"
    before = set(glob.glob(pattern))
    yield
    assert set(glob.glob(pattern)) == before


@pytest.fixture
def conn(shm_dir):
    c = SharedMemoryConnector({"shm_dir": shm_dir})
    yield c
    c.close()


def files(shm_dir) -> list[str]:
    return sorted(os.listdir(shm_dir))


def keys_in(shm_dir) -> list[str]:
    """Key entries: one per published key."""
    return sorted(n for n in os.listdir(shm_dir) if os.path.islink(os.path.join(shm_dir, n)))


def segments_in(shm_dir) -> list[str]:
    return sorted(n for n in os.listdir(shm_dir) if re.fullmatch(rf"{PREFIX}\d+-c\d+-s\d+", n))


def assert_same(got: dict, want: dict) -> None:
    assert shm_child.same_payload(got, want) == []


def small_payload(i: int = 0) -> dict:
    return {"t": torch.arange(10, dtype=torch.float32) + i, "b": b"raw%d" % i, "v": {"i": i}}


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CHILD), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _reap(proc: subprocess.Popen) -> None:
    """Kill the child if it still runs, wait for it, close its pipes."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stdout.close()
    proc.stderr.close()


def read_json_line(proc: subprocess.Popen, timeout: float = 60.0) -> dict:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            raise AssertionError(f"child said nothing within {timeout}s")
        line = proc.stdout.readline()
    finally:
        sel.close()
    if not line:
        proc.wait(timeout=10)
        raise AssertionError(f"child exited with {proc.returncode}: {proc.stderr.read()}")
    return json.loads(line)


# ---------------------------------------------------------------------------------- in-process use


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


# --------------------------------------------------------------------------------- other processes


def test_cross_process_exchange(conn, shm_dir):
    proc = spawn("exchange", shm_dir)
    try:
        hello = read_json_line(proc)
        assert hello["handle"]["segment"].startswith(f"{PREFIX}{hello['pid']}-")
        assert_same(conn.get("c2p", hello["handle"], timeout=10), shm_child.make_payload(1))
        assert_same(conn.get("c2p", timeout=10), shm_child.make_payload(1))  # key only
        conn.delete("c2p")
        conn.put("p2c", shm_child.make_payload(2))
        result = read_json_line(proc)
        assert result == {"ok": True, "bad": []}
        assert proc.wait(timeout=30) == 0
    finally:
        _reap(proc)
        conn.delete("c2p")
        conn.delete("p2c")
    assert keys_in(shm_dir) == []
    assert [n for n in files(shm_dir) if n.startswith(f"{PREFIX}{hello['pid']}-")] == []   # child cleaned up


def test_kill_9_leaves_orphans_that_sweep_removes(conn, shm_dir):
    proc = spawn("hold", shm_dir, "3")
    extra = []
    try:
        hello = read_json_line(proc)
        child_pid = hello["pid"]
        child_segments = sorted(h["segment"] for h in hello["handles"])
        conn.put("live", small_payload())
        mine = [n for n in files(shm_dir) if n.startswith(f"{PREFIX}{os.getpid()}-")]
        assert len(mine) == 3   # entry, segment, owner file
        # A live foreign owner (pid 1 always exists) and names that are not ours to judge.
        for name in (f"{PREFIX}1-{'ab' * 12}", f"{PREFIX}notapid-x", "unrelated-file"):
            open(os.path.join(shm_dir, name), "w").close()
            extra.append(name)
        childs = [n for n in files(shm_dir) if n.startswith(f"{PREFIX}{child_pid}-")]
        assert len(childs) == 7 and set(child_segments) <= set(childs)   # 3 entries, 3 segments, owner file
        assert files(shm_dir) == sorted(childs + mine + extra)

        os.kill(child_pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL  # reaped: no zombie that still "exists"
        assert files(shm_dir) == sorted(childs + mine + extra)  # a crash leaves segments

        # Data of a crashed producer is still readable until swept.
        assert_same(conn.get("orphan-1", hello["handles"][1], timeout=1), shm_child.make_payload(11))

        assert sweep_orphans(shm_dir) == 7
        assert files(shm_dir) == sorted(mine + extra)  # live owners' files are kept
        with pytest.raises(TransferFailed):
            conn.get("orphan-0", timeout=0.02)
        assert sweep_orphans(shm_dir) == 0  # idempotent

        # Explicit owners: removed even though alive.
        assert sweep_orphans(shm_dir, owners={os.getpid()}) == 3
        assert files(shm_dir) == sorted(extra)
        assert sweep_orphans(shm_dir, owners={1}) == 1
        assert files(shm_dir) == sorted(["unrelated-file", f"{PREFIX}notapid-x"])
    finally:
        _reap(proc)
        sweep_orphans(shm_dir, owners={proc.pid, os.getpid()})
        for name in extra:
            if os.path.exists(os.path.join(shm_dir, name)):
                os.unlink(os.path.join(shm_dir, name))


def test_sweep_ignores_other_directories(shm_dir):
    other = f"/dev/shm/ortest-{uuid.uuid4().hex}"
    os.mkdir(other)
    try:
        dead = os.path.join(other, f"{PREFIX}{_dead_pid()}-{'cd' * 12}")
        open(dead, "w").close()
        assert sweep_orphans(shm_dir) == 0
        assert os.path.exists(dead)
        assert sweep_orphans(other) == 1
    finally:
        shutil.rmtree(other)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_sweep_survives_absurd_pid_in_name(shm_dir):
    bogus = os.path.join(shm_dir, f"{PREFIX}99999999999999999999-x")
    dead = os.path.join(shm_dir, f"{PREFIX}{_dead_pid()}-{'ef' * 12}")
    for path in (bogus, dead):
        open(path, "w").close()
    try:
        sweep_orphans(shm_dir)
        assert not os.path.exists(dead)
    finally:
        for path in (bogus, dead):
            if os.path.exists(path):
                os.unlink(path)


def _can_mount_private_tmpfs(tmp_path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe}"],
                       capture_output=True, timeout=10)
    return r.returncode == 0


def test_put_on_full_shm_raises_instead_of_sigbus(tmp_path):
    if not _can_mount_private_tmpfs(tmp_path):
        pytest.skip("needs unshare + permission to mount a tmpfs in a private mount namespace")
    small = tmp_path / "small"
    small.mkdir()
    script = f'mount -t tmpfs -o size=256k tmpfs "$1" && exec "$2" "$3" enospc "$1"'
    r = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(small), sys.executable, str(CHILD)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"child died with {r.returncode} (-7/135 = SIGBUS): {r.stderr[-500:]}"
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["outcome"].startswith("raised"), result
    # Nothing half-written is left; the owner file marks the still-open connector.
    assert [n for n in result["left"] if not n.endswith("-owner")] == [], result


# ------------------------------------------------------------------------------------------ registry


def test_shared_memory_is_registered():
    assert "shared_memory" in available_connectors()


def test_create_connector_shared_memory(shm_dir):
    c = create_connector("shared_memory", {"shm_dir": shm_dir, "ttl_s": 5})
    try:
        assert isinstance(c, SharedMemoryConnector) and isinstance(c, Connector)
        assert c.ttl_s == 5.0 and c.shm_dir == shm_dir
    finally:
        c.close()


def test_unknown_connector_names_available_ones():
    with pytest.raises(ValueError) as info:
        create_connector("no_such_backend", {})
    assert "no_such_backend" in str(info.value)
    for name in available_connectors():
        assert name in str(info.value)


def test_unknown_option_rejected():
    with pytest.raises(ValueError) as info:
        create_connector("shared_memory", {"bogus": 1})
    assert "bogus" in str(info.value)


def test_shm_dir_must_exist(tmp_path):
    with pytest.raises(ValueError):
        create_connector("shared_memory", {"shm_dir": str(tmp_path / "missing")})


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made by a test go to a copy of the table and vanish afterwards."""
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))


def test_duplicate_registration_rejected(scratch_registry):
    with pytest.raises(ValueError):
        register_connector("shared_memory", "omnirelay.connectors.shared_memory:SharedMemoryConnector")
    register_connector("test_dummy", "omnirelay.connectors.shared_memory:SharedMemoryConnector")
    with pytest.raises(ValueError):
        register_connector("test_dummy", "omnirelay.connectors.shared_memory:SharedMemoryConnector")
    assert "test_dummy" in available_connectors()


def test_bad_registration_target(scratch_registry):
    with pytest.raises(ValueError):
        register_connector("no_colon", "omnirelay.connectors.shared_memory.SharedMemoryConnector")
    register_connector("not_a_connector", "omnirelay.errors:TransferFailed")
    with pytest.raises(TypeError):
        create_connector("not_a_connector", {})


def test_registry_changes_do_not_leak():
    assert "test_dummy" not in available_connectors()
    assert "not_a_connector" not in available_connectors()
