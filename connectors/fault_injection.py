"""``fault_injection`` connector: another backend with injected delays and failures.

For fault drills (staging, chaos tests): a pipeline YAML swaps the edge's ``type`` to
``fault_injection`` and names the real backend inside, e.g.::

    connectors:
      kv:
        type: fault_injection
        options: {inner: shared_memory, inner_options: {}, put_delay_s: 2.0, fail_every_nth_get: 0}

Options: ``inner`` / ``inner_options`` (the wrapped backend), ``put_delay_s`` and ``get_delay_s``
(sleep before each call: a slow link), ``fail_every_nth_put`` / ``fail_every_nth_get`` (every n-th
call raises :class:`~omnirelay.errors.TransferFailed`; 0 = never). Everything else is the inner
backend's behaviour, so the contract holds apart from the injected faults.
"""

from __future__ import annotations

import threading
import time

from omnirelay.errors import TransferFailed

from .base import DEFAULT_GET_TIMEOUT_S, ConnectorWrapper, Handle, Payload, Reservation
from .registry import create_connector


class FaultInjectionConnector(ConnectorWrapper):
    name = "fault_injection"

    def __init__(self, config: dict | None = None):
        config = dict(config or {})
        inner = config.pop("inner", "shared_memory")
        if inner == self.name:
            raise ValueError("fault_injection cannot wrap itself")
        inner_options = config.pop("inner_options", {})
        self.put_delay_s = float(config.pop("put_delay_s", 0.0))
        self.get_delay_s = float(config.pop("get_delay_s", 0.0))
        self.fail_every_nth_put = int(config.pop("fail_every_nth_put", 0))
        self.fail_every_nth_get = int(config.pop("fail_every_nth_get", 0))
        if config:
            raise ValueError(f"fault_injection connector: unknown options {sorted(config)}")
        if min(self.put_delay_s, self.get_delay_s, self.fail_every_nth_put, self.fail_every_nth_get) < 0:
            raise ValueError("fault_injection delays and failure periods must be >= 0")
        super().__init__(create_connector(inner, inner_options))
        # Its own name, and writes that may wait (put_delay_s) whatever the inner backend's are.
        self.name, self.local_writes = FaultInjectionConnector.name, False
        self._lock = threading.Lock()
        self._calls = {"put": 0, "get": 0}

    def _fault(self, op: str, delay_s: float, every_nth: int) -> None:
        if delay_s:
            time.sleep(delay_s)
        with self._lock:
            self._calls[op] += 1
            count = self._calls[op]
        if every_nth and count % every_nth == 0:
            raise TransferFailed(f"fault_injection: {op} #{count} failed on purpose")

    def put(self, key: str, payload: Payload) -> Handle:
        self._fault("put", self.put_delay_s, self.fail_every_nth_put)
        return self.inner.put(key, payload)

    def put_reserved(self, key: str, reservation: Reservation, extra: Payload | None = None) -> Handle:
        try:
            self._fault("put", self.put_delay_s, self.fail_every_nth_put)
        except BaseException:
            self.inner.release(reservation)
            raise
        return self.inner.put_reserved(key, reservation, extra)

    def get(self, key: str, handle: Handle | None = None, timeout: float = DEFAULT_GET_TIMEOUT_S) -> Payload:
        self._fault("get", self.get_delay_s, self.fail_every_nth_get)
        return self.inner.get(key, handle, timeout)

    def health(self) -> dict:
        with self._lock:
            calls = dict(self._calls)
        return {**self.inner.health(), "backend": self.name, "inner": self.inner.name,
                "injected_puts": calls["put"], "injected_gets": calls["get"]}
