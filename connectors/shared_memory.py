"""``shared_memory`` connector: POSIX shared memory segments under /dev/shm, one host.

A ``put`` writes the encoded payload into a fresh segment created under a temporary name and
renamed into place, so a consumer never maps a half-written segment. The segment name is
``omnirelay-<owner pid>-<key hash>``: the key hash makes key-only retrieval a directory lookup, and
the owner PID lets :func:`sweep_orphans` reclaim what a crashed producer left behind. A ``get`` maps
the segment copy-on-write, so tensors decoded from it are zero-copy; ``delete`` unlinks the name
(existing mappings stay valid until their tensors are garbage collected).

We use ``os.open`` + ``mmap`` on /dev/shm rather than ``multiprocessing.shared_memory`` because the
latter registers every segment with a resource tracker that unlinks (or warns about) segments
another process still needs.

Options: ``ttl_s`` (default 300): segments this producer wrote and nobody deleted are unlinked
after this long; ``shm_dir`` (default /dev/shm).
"""

from __future__ import annotations

import collections
import errno
import glob
import hashlib
import mmap
import os
import threading
import time

from omnirelay.errors import TransferFailed

from . import codec
from .base import DEFAULT_GET_TIMEOUT_S, DEFAULT_TTL_S, Connector, Handle, Payload

PREFIX = "omnirelay-"
SHM_DIR = "/dev/shm"


def _key_hash(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=12).hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_orphans(shm_dir: str = SHM_DIR, owners: set[int] | None = None) -> int:
    """Unlink segments whose owner process is dead (or, with ``owners``, that belong to those
    PIDs). Returns how many were removed. Safe to run at any time from any process."""
    removed = 0
    for path in glob.glob(os.path.join(shm_dir, PREFIX + "*")):
        parts = os.path.basename(path)[len(PREFIX):].split("-")
        try:
            pid = int(parts[0])
        except (ValueError, IndexError):
            continue
        if (owners is not None and pid in owners) or (owners is None and not _pid_alive(pid)):
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


class SharedMemoryConnector(Connector):
    name = "shared_memory"

    def __init__(self, config: dict | None = None):
        config = dict(config or {})
        self.shm_dir = str(config.pop("shm_dir", SHM_DIR))
        self.ttl_s = float(config.pop("ttl_s", DEFAULT_TTL_S))
        if config:
            raise ValueError(f"shared_memory connector: unknown options {sorted(config)}")
        if not os.path.isdir(self.shm_dir):
            raise ValueError(f"shared_memory connector: {self.shm_dir} is not a directory")
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._owned: collections.OrderedDict[str, float] = collections.OrderedDict()  # path → put time
        self._closed = False
        self._stats = collections.Counter()

    def _path(self, key: str, pid: int | None = None) -> str:
        return os.path.join(self.shm_dir, f"{PREFIX}{pid or self._pid}-{_key_hash(key)}")

    def put(self, key: str, payload: Payload) -> Handle:
        self._reap_expired(time.monotonic())
        encode_plan = codec.plan(payload)
        path = self._path(key)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, encode_plan.size)
            with mmap.mmap(fd, encode_plan.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mapping:
                view = memoryview(mapping)
                try:
                    codec.write_into(view, encode_plan)
                finally:
                    view.release()
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        os.close(fd)
        with self._lock:
            self._owned[path] = time.monotonic()
            self._stats["puts"] += 1
            self._stats["bytes_put"] += encode_plan.size
        return {"segment": os.path.basename(path), "size": encode_plan.size}

    def _locate(self, key: str, handle: Handle | None) -> str | None:
        if handle and isinstance(handle.get("segment"), str):
            name = os.path.basename(handle["segment"])
            if name.startswith(PREFIX):
                return os.path.join(self.shm_dir, name)
        matches = glob.glob(os.path.join(self.shm_dir, f"{PREFIX}*-{_key_hash(key)}"))
        return matches[0] if matches else None

    def get(self, key: str, handle: Handle | None = None, timeout: float = DEFAULT_GET_TIMEOUT_S) -> Payload:
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            path = self._locate(key, handle)
            if path is not None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    fd = -1
                if fd >= 0:
                    try:
                        size = os.fstat(fd).st_size
                        mapping = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
                    finally:
                        os.close(fd)
                    try:
                        payload = codec.decode(mapping)
                    except codec.CodecError as exc:
                        raise TransferFailed(f"segment for key {key!r} is corrupt: {exc}") from None
                    with self._lock:
                        self._stats["gets"] += 1
                        self._stats["bytes_got"] += size
                    return payload
            if time.monotonic() >= deadline:
                raise TransferFailed(f"shared_memory: key {key!r} not available within {timeout:.1f}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def delete(self, key: str) -> None:
        for path in glob.glob(os.path.join(self.shm_dir, f"{PREFIX}*-{_key_hash(key)}")):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            with self._lock:
                self._owned.pop(path, None)
                self._stats["deletes"] += 1

    def _reap_expired(self, now: float) -> None:
        expired = []
        with self._lock:
            while self._owned:
                path, put_at = next(iter(self._owned.items()))
                if now - put_at < self.ttl_s:
                    break
                self._owned.popitem(last=False)
                expired.append(path)
        for path in expired:
            try:
                os.unlink(path)
                self._stats["expired"] += 1
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise

    def close(self) -> None:
        """Reap expired segments; segments still awaiting their consumer stay (the sweep of dead
        owners reclaims them once this process is gone)."""
        if self._closed:
            return
        self._closed = True
        self._reap_expired(time.monotonic())

    def health(self) -> dict:
        with self._lock:
            return {"backend": self.name, "ok": not self._closed, "segments_pending": len(self._owned),
                    **{k: int(v) for k, v in self._stats.items()}}
