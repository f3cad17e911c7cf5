"""The ``shared_memory`` connector across processes: an exchange with a child process, a producer
killed with SIGKILL whose orphaned segments ``sweep_orphans`` removes (and what it must leave alone),
and a put into a full /dev/shm that must raise instead of dying of SIGBUS."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import uuid

import pytest

from omnirelay.connectors.shared_memory import PREFIX, sweep_orphans
from omnirelay.errors import TransferFailed

from shm_support import (CHILD, assert_same, conn, files, keys_in,  # noqa: F401  (fixtures)
                         no_segments_in_real_dev_shm, shm_child, small_payload)


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
