"""Where the project's shared data lives (fixed workloads, request traces, calibration data).

``$KVSERVE_SHARED_DIR`` if set, else ``<repo>/../shared`` (the layout of this project's
checkouts). Nothing at run time needs it: benchmarks, trace replay and cost-model refits do,
and say so when it is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    """``$KVSERVE_SHARED_DIR`` or ``<repo>/../shared`` (may not exist)."""
    return Path(os.environ.get("KVSERVE_SHARED_DIR") or (REPO_ROOT.parent / "shared"))
