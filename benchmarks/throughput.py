#!/usr/bin/env python
"""Offline throughput: kvserve vs transformers on the shared w64 workload (by default).

    python benchmarks/throughput.py [any `kvserve bench throughput` flag]

Same as ``kvserve bench throughput``; without ``--workload`` / ``--input-len`` it runs
``../shared/workloads/w64.jsonl`` relative to the repository root.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvserve.benchmarks.throughput import main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    if (
        "--workload" not in argv
        and "--input-len" not in argv
        and not any(a.startswith("--workload=") for a in argv)
    ):
        argv = ["--workload", str(REPO.parent / "shared" / "workloads" / "w64.jsonl")] + argv
    raise SystemExit(main(argv))
