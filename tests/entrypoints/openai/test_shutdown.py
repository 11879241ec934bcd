"""``kvserve serve`` as a real process: SIGTERM drains in-flight requests within
``--shutdown-grace-s`` (finishing them, or aborting them when the grace runs out) and exits 0."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


# uvicorn's start-up line; with ``--port 0`` it names the port the kernel gave the server
_LISTENING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


def _start(grace: float, tmp_path, name: str):
    """``kvserve serve`` on a port of the kernel's choosing (``--port 0``: no free port picked
    here that another process could take before the server binds it)."""
    log = open(tmp_path / f"{name}.log", "w+")
    cmd = [
        sys.executable,
        "-m",
        "kvserve.entrypoints.cli",
        "serve",
        "--port",
        "0",
        "--num-gpu-blocks",
        "32",
        "--max-model-len",
        "256",
        "--shutdown-grace-s",
        str(grace),
        "--log-level",
        "info",
    ]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, TOKENIZERS_PARALLELISM="false")
    )
    return proc, log


def _wait_healthy(proc, log, timeout=300) -> int:
    """The port of the server ``proc`` (read from its ``log``) once ``/health`` answers 200."""
    deadline = time.time() + timeout
    port = None
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise AssertionError(f"server exited early ({proc.returncode}):\n{log.read()[-3000:]}")
        if port is None:
            log.seek(0)
            m = _LISTENING.search(log.read())
            port = int(m.group(1)) if m else None
        if port is not None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    return port
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    log.seek(0)
    raise AssertionError(f"server did not become healthy:\n{log.read()[-3000:]}")


def _wait_draining(port, timeout=60):
    """Until the server on ``port`` shows it took the signal: ``/health`` answers 503 (draining)
    or nothing listens any more. A fixed sleep raced a loaded machine's signal handling."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 503:
                return
        except (httpx.ConnectError, httpx.RemoteProtocolError):  # the listening socket is closed
            return
        time.sleep(0.05)
    raise AssertionError(f"the server on port {port} never started draining")


def _stream(port, max_tokens, first_chunk: threading.Event, result: dict):
    body = {
        "prompt": "Write a story about a dragon.",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, reason = "", None
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reason = choice.get("finish_reason") or reason
                first_chunk.set()
    except httpx.HTTPError as e:
        result["error"] = repr(e)
    result["text"], result["finish_reason"] = text, reason
    first_chunk.set()


def test_sigterm_finishes_in_flight_then_exits_0_and_aborts_past_grace(tmp_path):
    # Two servers load in parallel: one with a long grace (in-flight request finishes), one with
    # a short grace and a long request (it is aborted when the grace runs out).
    long_proc, long_log = _start(30.0, tmp_path, "long")
    short_proc, short_log = _start(1.0, tmp_path, "short")
    try:
        long_port = _wait_healthy(long_proc, long_log)
        short_port = _wait_healthy(short_proc, short_log)
        runs = {}
        for name, port, max_tokens in (("long", long_port, 24), ("short", short_port, 200)):
            ev, res = threading.Event(), {}
            t = threading.Thread(target=_stream, args=(port, max_tokens, ev, res), daemon=True)
            t.start()
            assert ev.wait(60)
            runs[name] = (t, res)
        t_sig = time.time()
        long_proc.send_signal(signal.SIGTERM)
        short_proc.send_signal(signal.SIGTERM)
        _wait_draining(long_port)
        # stopped accepting: new connections are refused (or answered 503 while draining)
        try:
            code = httpx.post(
                f"http://127.0.0.1:{long_port}/v1/completions",
                json={"prompt": "hi", "max_tokens": 2},
                timeout=120,
            ).status_code
            assert code == 503
        except httpx.ConnectError:
            pass
        assert long_proc.wait(60) == 0
        assert short_proc.wait(60) == 0
        assert time.time() - t_sig < 45
        for t, _ in runs.values():
            t.join(10)
        long_res, short_res = runs["long"][1], runs["short"][1]
        assert long_res["status"] == 200 and long_res["finish_reason"] == "length", long_res
        # aborted when the grace ran out: the stream still ends cleanly, saying so
        assert short_res["status"] == 200 and short_res["finish_reason"] == "abort", short_res
        assert 0 < len(short_res["text"]) and "error" not in short_res
        long_log.seek(0)
        out = long_log.read()
        assert '"event":"request_finished"' in out and "dragon" not in out  # no prompt text by default
    finally:
        for p in (long_proc, short_proc):
            if p.poll() is None:
                p.kill()
                p.wait()
