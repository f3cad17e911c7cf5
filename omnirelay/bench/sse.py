"""An incremental parser for ``text/event-stream`` (the WHATWG server-sent events format).

Feed it the bytes as they arrive, in chunks cut anywhere (inside a UTF-8 character, between the
``\\r`` and ``\\n`` of a line end, inside a field name); it returns each event once its closing
blank line has arrived. Lines end with ``\\r\\n``, ``\\n`` or ``\\r``; ``data:`` lines of one event are
joined with ``\\n``; lines starting with ``:`` are comments; ``event:`` names the event; ``id:`` and
``retry:`` are ignored (a benchmark never reconnects). As the standard says, an event still open when
the stream ends is dropped, and so is an event without data.
"""

from __future__ import annotations

import dataclasses
import re

_LINE_END = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"


class SSEError(ValueError):
    """The stream is not an event stream we can parse (a line longer than the limit)."""


@dataclasses.dataclass(frozen=True)
class SSEEvent:
    data: str
    event: str = "message"


class SSEParser:
    """``feed(chunk) -> [SSEEvent, ...]``; one parser per stream, not thread-safe."""

    def __init__(self, max_line_bytes: int = 16 << 20):
        self._buffer = bytearray()
        self._data: list[str] = []
        self._event = ""
        self._max_line = max_line_bytes
        self._after_cr = False      # the last line ended with a lone \r: a leading \n is its other half
        self._started = False       # a leading BOM has been looked for

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._after_cr and chunk:
            self._after_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        self._buffer += chunk
        if not self._started:
            if len(self._buffer) < len(_BOM) and _BOM.startswith(bytes(self._buffer)):
                return []           # could still be a BOM: wait for more bytes
            if self._buffer.startswith(_BOM):
                del self._buffer[:len(_BOM)]
            self._started = True
        events: list[SSEEvent] = []
        pos = 0
        for match in _LINE_END.finditer(self._buffer):    # bounded by the bytes received
            event = self._line(bytes(self._buffer[pos:match.start()]))
            if event is not None:
                events.append(event)
            pos = match.end()
        if pos and self._buffer[pos - 1:pos] == b"\r":
            self._after_cr = True
        del self._buffer[:pos]
        if len(self._buffer) > self._max_line:
            raise SSEError(f"event-stream line longer than {self._max_line} bytes")
        return events

    def _line(self, raw: bytes) -> SSEEvent | None:
        if not raw:
            return self._dispatch()
        if raw[:1] == b":":
            return None
        line = raw.decode("utf-8", errors="replace")
        field, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, event = self._data, self._event or "message"
        self._data, self._event = [], ""
        if not data:
            return None
        return SSEEvent("\n".join(data), event)
