"""The child runs of this folder (``storm_child.py``), once per session: a crash of the child
(a request that killed the process) fails these tests with its exit status instead of killing
pytest."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Random request bodies hypothesis draws for the storm (``storm_child.random_bodies``).
NUM_RANDOM_BODIES = 40


def run_child(*args: str, timeout: float = 600) -> dict:
    """Run ``python -m tests.adversarial_e2e.storm_child ARGS``; returns ``returncode``,
    ``stderr`` (its tail) and ``result`` (the printed JSON, or None when it died)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.adversarial_e2e.storm_child", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    return {"returncode": proc.returncode, "stderr": proc.stderr[-4000:], "result": result}


def require_alive(run: dict) -> dict:
    """The child's result; fails (a death) if the child did not exit cleanly."""
    assert run["returncode"] == 0 and run["result"] is not None, (
        f"the process died (exit status {run['returncode']}):\n{run['stderr']}"
    )
    return run["result"]


@pytest.fixture(scope="session")
def single_run(tiny_llama_dir):
    """One engine: the offline shapes, then the HTTP storm (``storm_child.single``)."""
    return run_child("single", str(tiny_llama_dir), str(NUM_RANDOM_BODIES))


@pytest.fixture(scope="session")
def dp_run(tiny_llama_dir):
    """The crash-class shapes against a ``--data-parallel-size 2`` endpoint."""
    pytest.importorskip("ray")
    return run_child("dp", str(tiny_llama_dir))
