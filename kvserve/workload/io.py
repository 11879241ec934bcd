"""Output files for the tooling (simulator and benchmarks): strict JSON, atomic writes, and an
early check that an output path is writable before a long run starts."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _finite(obj: Any) -> Any:
    """JSON has no inf/nan: they become the strings "inf", "-inf", "nan"."""
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def check_output_path(flag: str, path: str | os.PathLike[str]) -> None:
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
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=".kvserve-check.")
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create a file in {parent} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(tmp)


def atomic_write(path: str | os.PathLike[str], write: Callable[[str], object]) -> None:
    """Create ``path``'s parent folders, call ``write(tmp)`` on a temporary path in the same
    folder (same suffix, so a plot's format is still inferred from it), then ``os.replace`` it
    onto ``path``: a crash or an error midway never leaves a half-written file at ``path``."""
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


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """``Path(path).write_text(text)``, atomically (``atomic_write``)."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Writes strict JSON (inf/nan as strings), creating the parent folder; atomically
    (``atomic_write``: the file is whole or not there)."""
    obj = _finite(obj)
    text = json.dumps(obj, indent=2, default=str, allow_nan=False) + "\n"
    write_text_atomic(path, text)
