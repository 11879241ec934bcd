"""llama.cpp's ``llama-server`` as a benchmark peer (``kvserve bench quantized --peer llama.cpp``).

The binary is built by ``benchmarks/llama_cpp/setup.sh`` (from the ``llama-cpp-python`` sdist's
vendored llama.cpp tree) into ``~/.cache/kvserve-bench/llama.cpp-<version>/bin``. This module
starts it on a GGUF file (127.0.0.1 only), sends ``/completion`` requests with token ids (the
same ids kvserve gets, so both engines see exactly the same prompt), and reads llama-server's
own ``timings`` block. Nothing here imports torch or kvserve's engine.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

#: ``llama-cpp-python`` version whose vendored llama.cpp setup.sh builds (keep in step with it).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"


def default_binary() -> Path:
    """Where ``benchmarks/llama_cpp/setup.sh`` puts ``llama-server`` (``$LLAMA_CPP_SERVER``
    overrides; ``$LLAMA_CPP_CACHE`` moves the cache folder as it does for setup.sh)."""
    env = os.environ.get("LLAMA_CPP_SERVER")
    if env:
        return Path(env)
    cache = Path(os.environ.get("LLAMA_CPP_CACHE", Path.home() / ".cache" / "kvserve-bench"))
    ver = os.environ.get("LLAMA_CPP_PYTHON_VERSION", LLAMA_CPP_PYTHON_VERSION)
    return cache / f"llama.cpp-{ver}" / "bin" / "llama-server"


@dataclass
class CompletionTiming:
    """One llama-server ``/completion`` response reduced to the figures the benchmark compares.

    Times in seconds. ``tpot_s`` follows kvserve's definition: decode time divided by
    ``output_tokens - 1`` (llama-server's ``predicted_ms`` starts when the prompt is done, so it
    covers the steps after the first token, which comes from the prompt's logits). The server's
    own ``predicted_per_token_ms`` is kept as ``server_tpot_s``: the llama.cpp that setup.sh
    builds divides by ``predicted_n - 1`` too, so both agree; older ones divided by
    ``predicted_n``."""

    prompt_tokens: int
    output_tokens: int
    prefill_s: float
    decode_s: float
    tpot_s: float | None
    server_tpot_s: float | None
    wall_s: float | None = None
    raw_timings: dict = field(default_factory=dict)

    @property
    def decode_tok_s(self) -> float | None:
        """1 / TPOT (tokens/s), ``None`` with fewer than two output tokens."""
        return 1.0 / self.tpot_s if self.tpot_s else None

    @property
    def overall_tok_s(self) -> float | None:
        """Output tokens per wall-clock second of the whole request (prefill included)."""
        return self.output_tokens / self.wall_s if self.wall_s else None

    def as_run(self) -> dict:
        """The per-run dict benchmarks/quantized.py records for every engine."""
        return {
            "decode_tok_s": self.decode_tok_s,
            "overall_tok_s": self.overall_tok_s,
            "ttft_s": self.prefill_s,
            "tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "server_tpot_ms": None if self.server_tpot_s is None else self.server_tpot_s * 1e3,
        }


def parse_timings(resp: dict, wall_s: float | None = None) -> CompletionTiming:
    """Reads a ``/completion`` response's ``timings`` (``prompt_n``, ``prompt_ms``,
    ``predicted_n``, ``predicted_ms``, ``predicted_per_token_ms``).

    Args:
        resp: the decoded JSON body.
        wall_s: the client's wall clock for the request (seconds), if measured.

    Raises:
        ValueError: no ``timings`` object, or a field missing / negative / not a number.
    """
    t = resp.get("timings") if isinstance(resp, dict) else None
    if not isinstance(t, dict):
        raise ValueError("llama-server response has no 'timings' object")

    def num(name: str) -> float:
        v = t.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"llama-server timings.{name} must be a finite non-negative number, got {v!r}")
        return float(v)

    n_prompt, prompt_ms = int(num("prompt_n")), num("prompt_ms")
    n_out, pred_ms = int(num("predicted_n")), num("predicted_ms")
    per_tok = t.get("predicted_per_token_ms")
    server_tpot = (
        float(per_tok) / 1e3
        if isinstance(per_tok, (int, float))
        and not isinstance(per_tok, bool)
        and math.isfinite(per_tok)
        and n_out > 0
        else None
    )
    return CompletionTiming(
        prompt_tokens=n_prompt,
        output_tokens=n_out,
        prefill_s=prompt_ms / 1e3,
        decode_s=pred_ms / 1e3,
        tpot_s=pred_ms / 1e3 / (n_out - 1) if n_out > 1 else None,
        server_tpot_s=server_tpot,
        wall_s=wall_s,
        raw_timings=dict(t),
    )


def completion_body(prompt_token_ids: list[int], n_predict: int) -> dict:
    """The ``/completion`` request: token ids in, exactly ``n_predict`` greedy tokens out.

    ``cache_prompt`` is off because kvserve runs without prefix caching here: every request
    prefills its whole prompt on both engines. ``return_tokens`` puts the generated ids in the
    response (to compare greedy outputs)."""
    return {
        "prompt": list(prompt_token_ids),
        "n_predict": int(n_predict),
        "ignore_eos": True,
        "temperature": 0.0,
        "top_k": 1,
        "cache_prompt": False,
        "stream": False,
        "return_tokens": True,
    }


def proc_memory_mib(pid: int) -> dict:
    """``VmRSS`` (now) and ``VmHWM`` (peak) of a process from ``/proc/<pid>/status``, in MiB
    (``{}`` when the process is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out["rss_mib" if key == "VmRSS" else "peak_rss_mib"] = int(rest.split()[0]) / 1024
    except OSError:
        pass
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A ``llama-server`` child process on 127.0.0.1; use as a context manager.

    Args:
        model: GGUF file.
        threads: ``-t`` and ``-tb`` (generation and prompt-processing threads).
        parallel: ``-np`` slots (1 for batch 1; N to run N requests at once).
        ctx_per_slot: context tokens per slot (``-c`` is ``parallel * ctx_per_slot``).
        binary: the executable (default: :func:`default_binary`).
        startup_timeout_s: how long to wait for ``/health``.
        extra_args: more llama-server flags.

    Raises:
        FileNotFoundError: the binary or the model is missing (run setup.sh).
        RuntimeError: the server exits or is not healthy within ``startup_timeout_s``.
    """

    def __init__(
        self,
        model: str | Path,
        threads: int = 2,
        parallel: int = 1,
        ctx_per_slot: int = 2048,
        binary: str | Path | None = None,
        startup_timeout_s: float = 120.0,
        extra_args: list[str] | None = None,
        log_path: str | Path | None = None,
    ):
        self.binary = Path(binary) if binary else default_binary()
        self.model = Path(model)
        if not self.binary.is_file():
            raise FileNotFoundError(
                f"llama-server not found at {self.binary}: run `bash benchmarks/llama_cpp/setup.sh` "
                "(or set LLAMA_CPP_SERVER)"
            )
        if not self.model.is_file():
            raise FileNotFoundError(f"GGUF model {self.model} not found")
        self.threads, self.parallel = threads, parallel
        self.ctx = parallel * ctx_per_slot
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = list(extra_args or [])
        self.log_path = Path(log_path) if log_path else None
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.load_s: float | None = None

    def command(self) -> list[str]:
        """The full argv the server is started with."""
        return [
            str(self.binary),
            "-m",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-t",
            str(self.threads),
            "-tb",
            str(self.threads),
            "-np",
            str(self.parallel),
            "-c",
            str(self.ctx),
            *self.extra_args,
        ]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LlamaServer:
        """Starts the process and waits until ``/health`` answers 200; sets ``load_s``."""
        self.port = _free_port()
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        deadline = t0 + self.startup_timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited with code {self.proc.returncode} at start"
                    + (f" (log: {self.log_path})" if self.log_path else "")
                )
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.load_s = time.perf_counter() - t0
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"llama-server not healthy within {self.startup_timeout_s:.0f} s")

    def complete(self, prompt_token_ids: list[int], n_predict: int, timeout_s: float = 600.0) -> tuple:
        """One ``/completion`` request; returns ``(CompletionTiming, response dict)``.

        Raises:
            RuntimeError: an HTTP error or a response without timings.
        """
        data = json.dumps(completion_body(prompt_token_ids, n_predict)).encode()
        req = urllib.request.Request(
            self.base_url + "/completion", data=data, headers={"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"llama-server /completion: HTTP {e.code}: {e.read()[:500]!r}") from e
        wall = time.perf_counter() - t0
        try:
            return parse_timings(body, wall), body
        except ValueError as e:
            raise RuntimeError(str(e)) from e

    def memory_mib(self) -> dict:
        """The server's current and peak RSS (MiB), see :func:`proc_memory_mib`."""
        return proc_memory_mib(self.proc.pid) if self.proc else {}

    def stop(self) -> None:
        """Terminates the process (kills it after 10 s)."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
