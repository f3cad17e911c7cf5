"""What every WebSocket route of the gateway shares: admission, the one writer, the idle clock, and
the error event.

Life of a connection (``/v1/realtime``, ``/v1/audio/speech/stream``)::

    GET with Upgrade ──admit: a free slot of ``max_websocket_sessions`` (else 503 before the upgrade)
        ──▶ WebSocketResponse prepared ──▶ the route's session loop: :meth:`EventSocket.receive`
        (JSON text frames only; idle for ``websocket_idle_timeout_s`` with nothing in flight → the
        session ends) ──▶ each event handled; replies through :meth:`EventSocket.send`
        ──▶ the client closes, or the route ends the session ──▶ the route cancels and joins its work
        (which cancels its requests upstream), the socket is closed, the slot freed

A malformed event never closes the connection: every frame passes the gateway's one JSON validator
(gateway/request_body.py: nesting, integer width, text encoding), and the client gets an ``error``
event naming what was wrong (OpenAI Realtime's shape, ``{"type": "error", "error": {"type", "code", "message", "param",
"event_id"}}``, with the gateway's ``request_id`` and ``stage`` beside it: gateway/error_answers.py)
and the session goes on. An unexpected exception in an event's handler (a bug) is the same: one
catch-all in :meth:`EventSocket.serve` logs it with its traceback and answers an ``internal_error``
event, never a silently closed session; a route's own tasks report theirs with :func:`unexpected`.

Back-pressure: every send waits for the transport to drain, for at most ``stream_write_timeout_s``;
a client that stops reading is disconnected, which cancels what it asked for, so a slow reader can
never hold a worker's KV cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from aiohttp import WSMsgType, web

from omnirelay.errors import BadRequest, OmniError, Unavailable

from .app_keys import CONFIG
from .cpu_work import off_loop
from .error_answers import error_event
from .request_body import OFF_LOOP_BYTES, parse_json

log = logging.getLogger("omnirelay.gateway")

# Frames larger than this are refused by aiohttp (close code 1009): the largest audio append a
# client may send in one event (OpenAI's buffer limit is 15 MiB of audio for a whole turn).
MAX_FRAME_BYTES = 16 * 1024 * 1024

SESSIONS: web.AppKey[dict[str, int]] = web.AppKey("websocket_sessions", dict)


class SessionClosed(Exception):
    """The client went away, stopped reading, or the session ended."""


def event_id() -> str:
    return f"event_{uuid.uuid4().hex[:20]}"


class EventSocket:
    """One prepared WebSocket of a route: JSON events in and out, one writer at a time."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse):
        self.request = request
        self.ws = ws
        config = request.app[CONFIG]
        self.write_timeout_s = config.stream_write_timeout_s
        self.idle_timeout_s = config.websocket_idle_timeout_s
        self._send_lock = asyncio.Lock()

    async def send(self, event: dict[str, Any]) -> None:
        """Send one event (``event_id`` added); SessionClosed when the client is gone or too slow."""
        if self.ws.closed:
            raise SessionClosed("the client closed the connection")
        data = json.dumps({"event_id": event_id(), **event}, separators=(",", ":"))
        try:
            async with self._send_lock, asyncio.timeout(self.write_timeout_s):
                await self.ws.send_str(data)
        except TimeoutError:
            await self.ws.close(code=1008, message=b"client too slow to read")
            raise SessionClosed(f"client did not read for {self.write_timeout_s:.0f}s") from None
        except (ConnectionResetError, RuntimeError) as exc:   # RuntimeError: closing transport
            raise SessionClosed(str(exc)) from None

    async def send_error(self, error: OmniError, client_event_id: str | None = None) -> None:
        event = error_event(error)
        event["error"]["event_id"] = client_event_id   # Realtime's: the client event this answers
        await self.send(event)

    async def serve(self, handlers: dict[str, Callable[[dict], Awaitable[None]]], busy: Callable[[], bool],
                    until: Callable[[], bool] = lambda: False) -> bool:
        """Hand each client event to ``handlers[event["type"]]`` until ``until()`` holds (True) or the
        client leaves or idles out (False; ``busy()`` says whether the idle clock is off). An event's
        OmniError (an unknown type included) becomes an error event and the session goes on; so does
        any other exception of a handler, logged as the bug it is (:func:`unexpected`)."""
        while not until():
            event = None
            try:
                event = await self.receive(busy=busy())
                if event is None:
                    return False
                handler = handlers.get(event["type"])
                if handler is None:
                    raise BadRequest(f"unknown event type {event['type']!r}", param="type")
                await handler(event)
            except OmniError as exc:
                await self.send_error(exc, event.get("event_id") if isinstance(event, dict) else None)
            except SessionClosed:
                raise
            except Exception as exc:   # the catch-all: a bug is reported, never a silent close
                where = f"event {event.get('type')!r}" if isinstance(event, dict) else "receiving an event"
                error = unexpected(exc, f"{self.request.path}: {where}")
                await self.send_error(error, event.get("event_id") if isinstance(event, dict) else None)
        return True

    async def receive(self, busy: bool) -> dict | None:
        """The next client event as a dict, or None when the session is over (closed by the client,
        or idle too long while not ``busy``). A frame that is not a JSON object raises BadRequest."""
        while True:
            try:
                message = await self.ws.receive(timeout=None if busy else self.idle_timeout_s)
            except asyncio.TimeoutError:
                await self.send_error(BadRequest(f"no event for {self.idle_timeout_s:.0f}s; closing the idle "
                                                 "session"))
                return None
            if message.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                return None
            if message.type == WSMsgType.BINARY:
                raise BadRequest("events are JSON text frames; binary frames are not accepted")
            if message.type != WSMsgType.TEXT:
                continue
            if len(message.data) > OFF_LOOP_BYTES:
                event = await off_loop(self.request.app, parse_json, message.data, "the event")
            else:
                event = parse_json(message.data, "the event")
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise BadRequest("an event is a JSON object with a string 'type'", param="type")
            return event


def unexpected(exc: BaseException, where: str, request_id: str = "") -> OmniError:
    """An exception no handler expected (a bug), logged with its traceback; the error to send in its
    place (``internal_error``: the client learns something failed, not the internals)."""
    log.error("WebSocket %s failed unexpectedly", where, exc_info=exc)
    return OmniError(f"internal error ({type(exc).__name__}); the session goes on", request_id=request_id)


def install(app: web.Application) -> None:
    """Give ``app`` the session counter the WebSocket routes share (idempotent)."""
    if SESSIONS not in app:
        app[SESSIONS] = {}


@contextlib.asynccontextmanager
async def event_socket(request: web.Request, route: str) -> AsyncIterator[EventSocket]:
    """The session's socket: admitted and upgraded on entry (:func:`open_event_socket`), closed and
    its slot freed on exit, however the session ends."""
    socket = await open_event_socket(request, route)
    try:
        yield socket
    finally:
        await close_event_socket(socket, route)


async def open_event_socket(request: web.Request, route: str) -> EventSocket:
    """Admit and upgrade (503 before the upgrade when every session slot is taken). The caller must
    end with :func:`close_event_socket`."""
    config = request.app[CONFIG]
    sessions = request.app[SESSIONS]
    if sum(sessions.values()) >= config.max_websocket_sessions:
        raise Unavailable(f"this gateway holds {config.max_websocket_sessions} WebSocket sessions already; "
                          "try again later")
    sessions[route] = sessions.get(route, 0) + 1
    ws = web.WebSocketResponse(max_msg_size=MAX_FRAME_BYTES, heartbeat=30.0)
    try:
        await ws.prepare(request)
    except BaseException:
        sessions[route] -= 1
        raise
    return EventSocket(request, ws)


async def close_event_socket(socket: EventSocket, route: str) -> None:
    socket.request.app[SESSIONS][route] -= 1
    if not socket.ws.closed:
        await socket.ws.close()


async def join(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (if still running) and wait for it to end, whatever it raised."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except BaseException:   # noqa: BLE001 - its outcome was already reported; joining is all that is left
        if not task.done():
            raise
