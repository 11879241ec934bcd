"""``kvserve serve --data-parallel-size 2`` as a real process (its own local Ray runtime): it
serves through one endpoint, SIGTERM drains the in-flight stream, the process exits 0 and its
replica processes are gone."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.entrypoints.openai.test_shutdown import _stream, _wait_healthy

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_serve_data_parallel_drains_on_sigterm_and_exits_0(tmp_path, tiny_llama_dir):
    pytest.importorskip("ray")
    import httpx

    log = open(tmp_path / "serve.log", "w+")
    cmd = [
        sys.executable,
        "-m",
        "kvserve.entrypoints.cli",
        "serve",
        "--model",
        str(tiny_llama_dir),
        "--port",
        "0",  # the kernel's choice, read from the log: no race for a free port
        "--data-parallel-size",
        "2",
        "--router",
        "least-loaded",
        "--num-gpu-blocks",
        "32",
        "--max-model-len",
        "256",
        "--shutdown-grace-s",
        "30",
    ]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, TOKENIZERS_PARALLELISM="false")
    )
    try:
        port = _wait_healthy(proc, log, timeout=300)
        log.seek(0)
        pids = [int(p) for p in re.findall(r"replica \d: pid (\d+)", log.read())]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": str(tiny_llama_dir), "prompt": "hello", "max_tokens": 5, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        ev, res = threading.Event(), {}
        t = threading.Thread(target=_stream, args=(port, 40, ev, res), daemon=True)
        t.start()
        assert ev.wait(60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        t.join(10)
        assert res["status"] == 200 and res["finish_reason"] == "length", res
        deadline = time.time() + 30
        while any(_alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "replica processes outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
