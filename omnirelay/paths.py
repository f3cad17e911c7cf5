"""Where omnirelay keeps what it builds for itself on a host (tiny models, compiled kernels).

One function, so the model builders and the workers that compile kernels agree on one directory
without either importing the other.
"""

from __future__ import annotations

import os
import pathlib


def cache_root() -> pathlib.Path:
    """``$OMNIRELAY_CACHE_DIR``, else ``$XDG_CACHE_HOME/omnirelay``, else ``~/.cache/omnirelay``."""
    if os.environ.get("OMNIRELAY_CACHE_DIR"):
        return pathlib.Path(os.environ["OMNIRELAY_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return pathlib.Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "omnirelay"
    return pathlib.Path.home() / ".cache" / "omnirelay"
