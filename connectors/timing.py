"""Transfer timing as a wrapper, not inside any backend: every ``put`` (``put_reserved`` too) and ``get`` is timed and the
totals join the wrapped backend's :meth:`health` (``put_us_total``/``get_us_total``, microseconds),
which workers report in their heartbeats and the gateway exports as connector transfer latency."""

from __future__ import annotations

import contextlib
import threading
import time

from .base import DEFAULT_GET_TIMEOUT_S, Connector, Handle, Layout, Payload, Reservation


class TimedConnector(Connector):
    def __init__(self, inner: Connector):
        self.inner = inner
        self.name = inner.name
        self.local_writes = inner.local_writes   # timing adds no wait
        self._lock = threading.Lock()
        self._us = {"put": 0, "get": 0}

    @contextlib.contextmanager
    def _timed(self, op: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self._us[op] += int((time.perf_counter() - started) * 1e6)

    def put(self, key: str, payload: Payload) -> Handle:
        with self._timed("put"):
            return self.inner.put(key, payload)

    def reserve(self, layout: Layout) -> Reservation:
        return self.inner.reserve(layout)

    def put_reserved(self, key: str, reservation: Reservation, extra: Payload | None = None) -> Handle:
        with self._timed("put"):   # a put, less the copy
            return self.inner.put_reserved(key, reservation, extra)

    def release(self, reservation: Reservation) -> None:
        self.inner.release(reservation)

    def get(self, key: str, handle: Handle | None = None, timeout: float = DEFAULT_GET_TIMEOUT_S) -> Payload:
        with self._timed("get"):
            return self.inner.get(key, handle, timeout)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def close(self) -> None:
        self.inner.close()

    def health(self) -> dict:
        with self._lock:
            timing = {"put_us_total": self._us["put"], "get_us_total": self._us["get"]}
        return {**self.inner.health(), **timing}
