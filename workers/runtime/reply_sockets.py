"""The worker's PUSH sockets to gateways (``Task.reply_to``): owned, bounded in number, closed when idle.

A worker pushes token deltas and media straight to the gateway that owns a request. Every gateway
it has served leaves an endpoint behind, and gateways come and go (a restart binds a new port), so
the sockets are kept in least-recently-used order: at most ``max_sockets`` are open (opening one
more closes the least recently used), and :meth:`ReplySockets.close_idle`, called by the loop with
each heartbeat, closes those unused for ``idle_s``. A closed one is opened again on its next send.

An endpoint is checked (:func:`omnirelay.endpoints.endpoint_error`) before any socket exists for
it, and a socket whose set-up fails (a malformed CURVE key, a ``connect()`` that raises) is closed
at once: an open socket would keep the worker's ``zmq.Context.term()`` waiting for ever at
shutdown. An endpoint refused is remembered (in the same bounded order), so a request's every
delta does not log again.

Thread: the worker loop's only; nothing here blocks (sends are ``NOBLOCK``; a gateway that does not
read loses deltas, logged, rather than stalling the batch).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

import zmq

from omnirelay.broker import protocol as p
from omnirelay.endpoints import endpoint_error
from omnirelay.security import CurveKeys, is_loopback

log = logging.getLogger("omnirelay.worker")

MAX_REPLY_SOCKETS = 64   # gateways one worker answers at once, in practice a handful
MAX_KNOWN_KEYS = 4096    # CURVE keys remembered per endpoint: kept apart from (and longer than) the
                         # sockets, so a socket closed for room reopens with its gateway's key
IDLE_CLOSE_S = 120.0     # a socket unused this long is closed (a restarted gateway's old port)
LINGER_MS = 1000         # what a closed socket still owes its gateway gets this long to leave
SNDHWM = 100_000


@dataclasses.dataclass
class _Reply:
    sock: zmq.Socket | None = None     # None until the first send, and after a refusal
    refused: bool = False              # set-up failed: drop what is sent here, quietly
    used: float = 0.0                  # monotonic time of the last send or key note


class ReplySockets:
    def __init__(self, ctx: zmq.Context, keys: CurveKeys | None = None, *,
                 max_sockets: int = MAX_REPLY_SOCKETS, idle_s: float = IDLE_CLOSE_S):
        self._ctx = ctx
        self._keys = keys
        self._max = max_sockets
        self._idle_s = idle_s
        self._entries: collections.OrderedDict[str, _Reply] = collections.OrderedDict()
        # endpoint → its gateway's CURVE public key (z85; "" on loopback), least recently noted first
        self._known_keys: collections.OrderedDict[str, str] = collections.OrderedDict()

    @property
    def open_sockets(self) -> int:
        return sum(entry.sock is not None for entry in self._entries.values())

    def note_key(self, endpoint: str, key: str, now: float | None = None) -> None:
        """Remember ``endpoint``'s CURVE key (from a Task's ``reply_key``) for its socket."""
        if self._known_keys.get(endpoint) != key:
            entry = self._entries.get(endpoint)
            if entry is not None:
                self._close(entry)   # a new key is a new server: reconnect with it
        self._known_keys[endpoint] = key
        self._known_keys.move_to_end(endpoint)
        while len(self._known_keys) > MAX_KNOWN_KEYS:
            self._known_keys.popitem(last=False)
        entry = self._touch(endpoint, time.monotonic() if now is None else now)
        entry.refused = False   # a new task for it: worth another try

    def send(self, endpoint: str, msg: p.Message, now: float | None = None) -> None:
        """Push ``msg`` to ``endpoint`` ("" = nobody: dropped), opening its socket if need be."""
        if not endpoint:
            return
        entry = self._touch(endpoint, time.monotonic() if now is None else now)
        if entry.sock is None:
            if entry.refused:
                return
            entry.sock = self._open(endpoint, self._known_keys.get(endpoint, ""))
            if entry.sock is None:
                entry.refused = True
                return
        try:
            entry.sock.send_multipart(p.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("gateway %s is not reading; dropped a token delta", endpoint)

    def close_idle(self, now: float | None = None) -> int:
        """Close and forget the endpoints unused for ``idle_s``; returns how many were forgotten."""
        now = time.monotonic() if now is None else now
        stale = [endpoint for endpoint, entry in self._entries.items() if now - entry.used > self._idle_s]
        for endpoint in stale:
            self._close(self._entries.pop(endpoint))
        return len(stale)

    def close(self) -> None:
        for entry in self._entries.values():
            self._close(entry)
        self._entries.clear()

    # ------------------------------------------------------------------ internals

    def _touch(self, endpoint: str, now: float) -> _Reply:
        """``endpoint``'s entry, made the most recently used; the least recently used beyond the
        bound are closed and forgotten."""
        entry = self._entries.get(endpoint)
        if entry is None:
            entry = self._entries[endpoint] = _Reply()
            while len(self._entries) > self._max:
                _, evicted = self._entries.popitem(last=False)
                self._close(evicted)
        else:
            self._entries.move_to_end(endpoint)
        entry.used = now
        return entry

    def _open(self, endpoint: str, key: str) -> zmq.Socket | None:
        """A PUSH socket connected to ``endpoint``, or None (logged) when it may not or cannot be."""
        if reason := endpoint_error(endpoint):
            log.error("not sending to reply_to %r: %s", endpoint[:80], reason)
            return None
        if not (key and self._keys) and not is_loopback(endpoint):
            log.error("refusing to send tokens to %s without CURVE", endpoint)
            return None
        sock = self._ctx.socket(zmq.PUSH)
        try:
            if key and self._keys:
                self._keys.make_client(sock, server_key=key.encode())
            sock.setsockopt(zmq.LINGER, LINGER_MS)
            sock.setsockopt(zmq.SNDHWM, SNDHWM)
            sock.connect(endpoint)
        except (zmq.ZMQError, ValueError, TypeError) as exc:
            sock.close(0)   # an open socket would keep the context from terminating
            log.error("cannot connect to reply_to %r: %s", endpoint[:80], exc)
            return None
        return sock

    @staticmethod
    def _close(entry: _Reply) -> None:
        if entry.sock is not None:
            entry.sock.close()
            entry.sock = None
