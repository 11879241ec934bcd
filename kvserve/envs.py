"""Paths the project reads from its environment variables.

``KVSERVE_CACHE_DIR``: where converted models, content-hash memos and the compiled CPU kernels
are kept (default ``~/.cache/kvserve``).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$KVSERVE_CACHE_DIR`` or ``~/.cache/kvserve`` (read at each call, so a test or a process
    may change it)."""
    env = os.environ.get("KVSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvserve"
