"""Reading a request's JSON body under the gateway's limits: a size bound (``max_body_bytes``, set
on the app) and one deadline for the whole body (``read_timeout_s``); then :func:`parse_json`, the one
validator every JSON the gateway reads from a client passes (HTTP bodies here, WebSocket events in
gateway/websocket_session.py), so malformed input is a 400 naming where it is, never a 500 from
whatever later code trips on it:

- nesting deeper than :data:`MAX_DEPTH` (Python's parser would raise RecursionError at ~1000 levels);
- an integer outside the signed 64-bit range (the bus's msgpack and the workers take no wider ones),
  rejected from its digits before ``int()`` runs, so a 4,300-digit literal costs nothing either;
- ``NaN`` / ``Infinity`` (not JSON; Python's parser takes them) and numbers beyond a double (``1e999``);
- a string or key that is not valid Unicode text (a lone surrogate such as ``"\ud800"`` cannot be
  encoded as UTF-8, so a tokenizer or a log line would fail on it).

The walk is iterative and linear in the document; bodies over :data:`OFF_LOOP_BYTES` are parsed on the
gateway's CPU pool (gateway/cpu_work.py) so one large body does not hold the event loop."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from aiohttp import web

from omnirelay.errors import BadRequest, OmniError, PayloadTooLarge

from .app_keys import CONFIG
from .cpu_work import off_loop

MAX_DEPTH = 128                      # objects and arrays nested in one another
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
OFF_LOOP_BYTES = 64 * 1024           # larger bodies are parsed on the CPU pool


class RequestTimeout(OmniError):
    """The body did not arrive within ``read_timeout_s``: the client is gone or too slow to serve.
    The error middleware answers it and closes the connection (gateway/middleware.py)."""

    error_type, status, openai_type = "request_timeout", 408, "invalid_request_error"


async def json_body(request: web.Request) -> Any:
    """The parsed JSON body; 413 over the size bound, 408 past the deadline, 400 if not JSON."""
    config = request.app[CONFIG]
    try:
        # One deadline for the whole body: a client sending it byte by byte cannot reset it.
        async with asyncio.timeout(config.read_timeout_s):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body exceeds {config.max_body_bytes} bytes") from None
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {config.read_timeout_s:g}s") from None
    if len(raw) > OFF_LOOP_BYTES:
        return await off_loop(request.app, parse_json, raw, "request body")
    return parse_json(raw, "request body")


class _Refused:
    """What the parser's hooks put in place of a value JSON may hold but the gateway refuses; the walk
    reports it with its path (the hooks themselves cannot know where they are)."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why


def _int(digits: str) -> int | _Refused:
    if len(digits.lstrip("-")) > 19:   # int64 has 19 digits: refuse before int() parses thousands of them
        return _Refused("is an integer outside the signed 64-bit range")
    value = int(digits)
    return value if INT64_MIN <= value <= INT64_MAX else _Refused("is an integer outside the signed 64-bit range")


def _constant(name: str) -> _Refused:
    return _Refused(f"is {name}, which is not JSON")


def _float(text: str) -> float | _Refused:
    value = float(text)
    return value if math.isfinite(value) else _Refused(f"is a number too large for a double ({text[:32]})")


def parse_json(raw: bytes | str, what: str) -> Any:
    """``raw`` parsed and validated (the rules in the module docstring); BadRequest naming the path
    (``param``, e.g. ``messages[3].content``) of what is wrong. ``what`` names the document in messages."""
    try:
        value = json.loads(raw, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise BadRequest(f"{what} is nested more than {MAX_DEPTH} levels deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc}") from None
    _check(value, what)
    return value


def _check(root: Any, what: str) -> None:
    # (value, its path, depth). A path is a linked list (parent path, key or index), None at the root:
    # built in O(1) per value, spelled out only for a value that is refused.
    stack: list[tuple[Any, Any, int]] = [(root, None, 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and not _encodable(value):
                raise _refusal(path, "holds a lone surrogate (not valid Unicode text)", what)
        elif isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:   # named by its top-level key: the full path would be MAX_DEPTH long
                while path is not None and path[0] is not None:
                    path = path[0]
                raise _refusal(path, f"nests objects and arrays more than {MAX_DEPTH} levels deep", what)
            if isinstance(value, list):
                stack.extend((v, (path, i), depth + 1) for i, v in enumerate(value))
                continue
            for k, v in value.items():
                if not k.isascii() and not _encodable(k):
                    raise _refusal(path, f"has a key with a lone surrogate ({k!a})", what)
                stack.append((v, (path, k), depth + 1))
        elif isinstance(value, _Refused):
            raise _refusal(path, value.why, what)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _refusal(path: Any, why: str, what: str) -> BadRequest:
    """BadRequest naming ``path`` as the API's params are named: ``messages[0].content``."""
    parts = []
    while path is not None:
        path, key = path
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    name = "".join(reversed(parts)).lstrip(".")
    return BadRequest(f"{name or what} {why}", param=name or None)
