"""The child runs of this folder (``storm_child.py``), once per session: a crash of the child
(a request that killed the process) fails these tests with its exit status instead of killing
pytest. The children the selected tests need start together, so the data-parallel run's Ray
start-up overlaps the single engine's storm."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

#: Random request bodies hypothesis draws for the storm (``storm_child.random_bodies``).
NUM_RANDOM_BODIES = 40
#: Most seconds a child may run (a hang fails the tests instead of holding the run).
CHILD_TIMEOUT_S = 600
#: Test modules -> the child run they read.
_MODULES = {"test_server_storm": "single", "test_offline_shapes": "single", "test_dp_storm": "dp"}


class _Child:
    """One ``python -m tests.adversarial_e2e.storm_child ARGS`` process, started at once."""

    def __init__(self, *args: str):
        root = Path(__file__).resolve().parents[2]
        env = dict(os.environ, PYTHONPATH=str(root))
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.adversarial_e2e.storm_child", *args],
            cwd=root,
            env=env,
            stdout=self.out,
            stderr=self.err,
            text=True,
        )
        self._run: dict | None = None

    def run(self) -> dict:
        """``returncode``, ``stderr`` (its tail) and ``result`` (the printed JSON, or None when
        the child died); waits for the child."""
        if self._run is None:
            try:
                code = self.proc.wait(CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait()
            self.out.seek(0)
            self.err.seek(0)
            lines = self.out.read().strip().splitlines()
            result = json.loads(lines[-1]) if code == 0 and lines else None
            self._run = {"returncode": code, "stderr": self.err.read()[-4000:], "result": result}
        return self._run

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        self.err.close()


def require_alive(run: dict) -> dict:
    """The child's result; fails (a death) if the child did not exit cleanly."""
    assert run["returncode"] == 0 and run["result"] is not None, (
        f"the process died (exit status {run['returncode']}):\n{run['stderr']}"
    )
    return run["result"]


class _Children:
    """The child runs of the session by kind (``single``, ``dp``), each started once."""

    def __init__(self, model_dir: str):
        self.args = {"single": ("single", model_dir, str(NUM_RANDOM_BODIES)), "dp": ("dp", model_dir)}
        self.started: dict[str, _Child] = {}

    def start(self, kind: str) -> _Child:
        if kind not in self.started:
            self.started[kind] = _Child(*self.args[kind])
        return self.started[kind]

    def run(self, kind: str) -> dict:
        return self.start(kind).run()


@pytest.fixture(scope="session")
def _children(request, tiny_llama_dir):
    """Starts now every child run the selected tests of this folder read."""
    children = _Children(str(tiny_llama_dir))
    wanted = {
        kind
        for item in request.session.items
        for module, kind in _MODULES.items()
        if item.nodeid.startswith(f"tests/adversarial_e2e/{module}.py")
    }
    if importlib.util.find_spec("ray") is None:
        wanted.discard("dp")
    for kind in sorted(wanted):
        children.start(kind)
    yield children
    for child in children.started.values():
        child.close()


@pytest.fixture(scope="session")
def single_run(_children):
    """One engine: the offline shapes, then the HTTP storm (``storm_child.single``)."""
    return _children.run("single")


@pytest.fixture(scope="session")
def dp_run(_children):
    """The crash-class shapes against a ``--data-parallel-size 2`` endpoint."""
    pytest.importorskip("ray")
    return _children.run("dp")
