"""A progress bar for loading model weights: redrawn in place on a terminal, a log line per quarter
otherwise (journald and log files get four lines, not hundreds)."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("omnirelay.worker")


class LoadProgress:
    def __init__(self, what: str, total: int, stream=None):
        self.what = what
        self.total = max(total, 1)
        self.done = 0
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty()
        self._next_quarter = 1
        self._start = time.monotonic()

    def advance(self, count: int = 1) -> None:
        self.done = min(self.total, self.done + count)
        if self._tty:
            filled = 30 * self.done // self.total
            self._stream.write(f"\r{self.what} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}")
            if self.done == self.total:
                self._stream.write(f" in {time.monotonic() - self._start:.1f}s\n")
            self._stream.flush()
        elif self.done * 4 >= self._next_quarter * self.total:
            log.info("%s: %d/%d (%d%%)", self.what, self.done, self.total, 100 * self.done // self.total)
            self._next_quarter = 4 * self.done // self.total + 1
