"""Transfer timing as a wrapper, not inside any backend: every ``put`` (``put_reserved`` too) and ``get`` is timed and the
totals join the wrapped backend's :meth:`health` (``put_us_total``/``get_us_total``, microseconds),
which workers report in their heartbeats and the gateway exports as connector transfer latency.

A watcher (:meth:`TimedConnector.watch`, the worker's tracer) also hears of each transfer once it
ends: ``watcher(op, key, nbytes, start_ns, end_ns, error)`` with wall-clock nanoseconds, the bytes of
the payload put or got (tensors and byte strings; a reserved put's tensors count, though written
in place beforehand) and the error's text ("" on success). It is called on the thread that ran the transfer
(a transfer thread, or the loop's for an inline write), so it must be quick and thread-safe."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import torch

from .base import DEFAULT_GET_TIMEOUT_S, Connector, ConnectorWrapper, Handle, Payload, Reservation

TransferWatcher = Callable[[str, str, int, int, int, str], None]


def payload_nbytes(payload: Payload | None) -> int:
    """Bytes of a payload's tensors and byte strings (its msgpack values are not counted)."""
    total = 0
    for value in (payload or {}).values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, (bytes, bytearray)):
            total += len(value)
        elif isinstance(value, memoryview):
            total += value.nbytes
    return total


class TimedConnector(ConnectorWrapper):
    def __init__(self, inner: Connector):
        super().__init__(inner)   # its local_writes too: timing adds no wait
        self._lock = threading.Lock()
        self._us = {"put": 0, "get": 0}
        self._watcher: TransferWatcher | None = None

    def watch(self, watcher: TransferWatcher) -> None:
        """Tell ``watcher`` of every transfer from now on (see the module docstring); set it before
        the first transfer, from the thread that owns the connector."""
        self._watcher = watcher

    @contextlib.contextmanager
    def _timed(self, op: str, key: str = "", payload: Payload | None = None):
        """Time the block; a watcher also gets the payload's bytes: ``payload`` for a put, or what
        the block puts in the yielded list for a get."""
        started = time.perf_counter()
        watcher = self._watcher
        started_ns = time.time_ns() if watcher is not None else 0
        got: list[Payload] = []
        error = ""
        try:
            yield got
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"[:200]
            raise
        finally:
            with self._lock:
                self._us[op] += int((time.perf_counter() - started) * 1e6)
            if watcher is not None:
                watcher(op, key, payload_nbytes(payload if payload is not None else (got[0] if got else None)),
                        started_ns, time.time_ns(), error)

    def put(self, key: str, payload: Payload) -> Handle:
        with self._timed("put", key, payload):
            return self.inner.put(key, payload)

    def put_reserved(self, key: str, reservation: Reservation, extra: Payload | None = None) -> Handle:
        # A put, less the copy; its bytes are the reserved tensors' (written in place) and the extra's.
        written = {**reservation.tensors, **(extra or {})} if self._watcher is not None else None
        with self._timed("put", key, written):
            return self.inner.put_reserved(key, reservation, extra)

    def get(self, key: str, handle: Handle | None = None, timeout: float = DEFAULT_GET_TIMEOUT_S) -> Payload:
        with self._timed("get", key) as got:
            payload = self.inner.get(key, handle, timeout)
            got.append(payload)
            return payload

    def health(self) -> dict:
        with self._lock:
            timing = {"put_us_total": self._us["put"], "get_us_total": self._us["get"]}
        return {**self.inner.health(), **timing}
