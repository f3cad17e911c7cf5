"""The weight-loading progress bar: drawn in place on a terminal, four log lines otherwise."""

from __future__ import annotations

import io
import logging

from omnirelay.workers.runtime.load_progress import LoadProgress
from omnirelay.workers.llm.models.llama import LlamaModel


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_on_a_terminal():
    out = _Terminal()
    progress = LoadProgress("loading m", 10, stream=out)
    for _ in range(10):
        progress.advance()
    text = out.getvalue()
    assert text.count("\r") == 10 and "10/10" in text and text.endswith("s\n")
    assert "[" + "#" * 30 + "]" in text


def test_quarters_in_the_log(tiny_model, caplog):
    with caplog.at_level(logging.INFO, logger="omnirelay.worker"):
        LlamaModel(tiny_model)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loading ")]
    assert len(lines) == 4 and lines[-1].endswith("(100%)")
