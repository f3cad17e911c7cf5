"""A real connector whose calls on chosen keys wait until the test lets them through.

"While a transfer is pending" then is a state the test controls: the engine tests count progress in
steps and tokens, never in time. Gets, puts and in-place puts (``put_reserved``) of a held key
block in whichever thread makes them (an engine's transfer thread) until :meth:`HeldConnector.let_through`.
"""

from __future__ import annotations

import threading

from omnirelay.connectors import Connector, ConnectorWrapper
from omnirelay.errors import TransferFailed


class HeldConnector(ConnectorWrapper):
    """The real connector, except that a get or put of a held key waits until :meth:`let_through`,
    and the next get of a key marked with :meth:`fail_once` fails (as a get that timed out would)."""

    def __init__(self, inner: Connector):
        super().__init__(inner)
        # Writes that may wait (a held key) go to a transfer thread, whatever the inner backend's are.
        self.name, self.local_writes = "held", False
        self._gates: dict[str, threading.Event] = {}
        self._failing: set[str] = set()
        self.entered: dict[str, threading.Event] = {}
        self.gets: list[str] = []
        self.puts: list[str] = []
        self.deletes: list[str] = []
        self._delete_gates: dict[str, threading.Event] = {}
        self.threads: set[threading.Thread] = set()

    def hold(self, key: str) -> None:
        self._gates[key] = threading.Event()
        self.entered[key] = threading.Event()

    def let_through(self, key: str | None = None) -> None:
        for name, gate in [*self._gates.items(), *self._delete_gates.items()]:
            if key is None or name == key:
                gate.set()

    def hold_delete(self, key: str) -> None:
        """Deletes of ``key`` wait until :meth:`let_through` (its gets and puts pass)."""
        self._delete_gates[key] = threading.Event()
        self.entered[key] = threading.Event()

    def fail_once(self, key: str) -> None:
        self._failing.add(key)

    def wait_entered(self, key: str) -> None:
        assert self.entered[key].wait(10), f"no thread reached the call on {key!r}"

    def join_threads(self, timeout: float = 10) -> None:
        """Wait for every thread that called through this connector to end (an engine's transfer
        threads after its close(): one left inside a held call ends once the call returns)."""
        for thread in list(self.threads):
            thread.join(timeout)
            assert not thread.is_alive(), f"{thread.name} still running"

    def _pass(self, key: str) -> None:
        self.threads.add(threading.current_thread())
        if key in self._gates:
            self.entered[key].set()
            assert self._gates[key].wait(30), "the test never let the call through"

    def get(self, key, handle=None, timeout=30.0):
        self.gets.append(key)
        self._pass(key)
        if key in self._failing:
            self._failing.discard(key)
            raise TransferFailed(f"get of {key!r} timed out (on purpose)")
        return self.inner.get(key, handle, timeout)

    def put(self, key, payload):
        self.puts.append(key)
        self._pass(key)
        return self.inner.put(key, payload)

    def put_reserved(self, key, reservation, extra=None):
        self.puts.append(key)
        self._pass(key)
        return self.inner.put_reserved(key, reservation, extra)

    def delete(self, key):
        self.deletes.append(key)
        self.threads.add(threading.current_thread())
        if key in self._delete_gates:
            self.entered[key].set()
            assert self._delete_gates[key].wait(30), "the test never let the delete through"
        self.inner.delete(key)

    def close(self):
        """The test owns the inner connector."""
