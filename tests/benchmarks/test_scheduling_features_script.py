"""``benchmarks/scheduling_features.py`` reads its workload from the shared data folder that
``KVSERVE_SHARED_DIR`` names, and says so when it is missing instead of a traceback."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_missing_workload_is_an_error_naming_the_path_and_the_variable(tmp_path):
    env = {**os.environ, "KVSERVE_SHARED_DIR": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "scheduling_features.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 1
    assert r.stderr.strip() == (
        f"error: {tmp_path / 'workloads' / 'w256.jsonl'}: no such workload "
        "(set KVSERVE_SHARED_DIR to the shared data folder)"
    )
