"""A plain one-line progress bar on stderr, redrawn at most ten times a second; silent when off."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 30


class ProgressBar:
    def __init__(self, total: int, label: str = "", enabled: bool = True, stream: TextIO | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.done = 0
        self.failed = 0
        self._start = time.monotonic()
        self._drawn = 0.0
        self._draw(force=True)

    def update(self, ok: bool = True) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        self._draw(force=self.done >= self.total)

    def close(self) -> None:
        if self.enabled:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._drawn < 0.1):
            return
        self._drawn = now
        filled = _WIDTH * min(self.done, self.total) // self.total
        elapsed = now - self._start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        failed = f" {self.failed} failed" if self.failed else ""
        self.stream.write(f"\r{self.label}[{'#' * filled}{'.' * (_WIDTH - filled)}] {self.done}/{self.total} "
                          f"{rate:.1f} req/s {elapsed:.0f}s{failed} ")
        self.stream.flush()
