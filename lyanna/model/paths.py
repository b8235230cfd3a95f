"""Where Lyanna keeps what it builds or fetches once per machine: the converted default
model, its GGUF, the native decoder's builds and the calibration file. A leaf module, so that
every part of ``lyanna.model`` can find the cache without importing the fetcher."""

from __future__ import annotations

import os
from pathlib import Path

MARKER = "lyanna-source.json"  # written beside a converted model: which GGUF it came from


def cache_root() -> Path:
    return Path(os.environ.get("LYANNA_CACHE", Path.home() / ".cache" / "lyanna"))
