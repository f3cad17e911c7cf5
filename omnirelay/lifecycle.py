"""Process lifecycle shared by the daemons: logging set-up and signal handling that only flips a flag."""

from __future__ import annotations

import enum
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


def setup_logging(name: str, level: str = "INFO") -> None:
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level.upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s {name}[%(process)d] %(name)s: %(message)s")
