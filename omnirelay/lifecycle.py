"""Process lifecycle shared by the daemons: logging set-up and signal handling that only flips a flag."""

from __future__ import annotations

import enum
import json
import logging
import signal
import sys
import threading


class ShutdownState(enum.Enum):
    RUNNING = "running"
    REQUESTED = "requested"      # a signal arrived; the main loop stops taking work
    STOPPING = "stopping"        # draining / closing sockets


class Shutdown:
    """Owned by a daemon's main loop. Signal handlers only call :meth:`request`; the loop reads
    :attr:`requested` between steps and runs its own drain."""

    def __init__(self) -> None:
        self.state = ShutdownState.RUNNING
        self.event = threading.Event()

    @property
    def requested(self) -> bool:
        return self.state is not ShutdownState.RUNNING

    def request(self, *_args) -> None:
        if self.state is ShutdownState.RUNNING:
            self.state = ShutdownState.REQUESTED
        self.event.set()

    def install(self) -> "Shutdown":
        signal.signal(signal.SIGTERM, self.request)
        signal.signal(signal.SIGINT, self.request)
        return self


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers."""

    def __init__(self, daemon: str):
        super().__init__()
        self._daemon = daemon

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 6), "level": record.levelname, "daemon": self._daemon,
                 "pid": record.process, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(name: str, level: str = "INFO", log_format: str = "text") -> None:
    """``log_format``: ``text`` (one readable line) or ``json`` (one JSON object per line)."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(name))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {name}[%(process)d] %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)


def add_logging_arguments(parser) -> None:
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=["text", "json"], default="text")
