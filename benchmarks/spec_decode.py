#!/usr/bin/env python
"""Speculative decoding: off vs n-gram vs draft model on an input-grounded workload (single
user, 8 concurrent) and on w64 offline.

    python benchmarks/spec_decode.py [any `kvserve bench spec-decode` flag]

Same as ``kvserve bench spec-decode`` (see ``kvserve/benchmarks/spec_decode.py``). The full run
takes long on a small machine; a smoke run: ``--num-requests 2 --output-len 16 --scenarios single``.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvserve.benchmarks.spec_decode import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
