"""Every ``KVSERVE_*`` environment variable, declared once: name, type, default, meaning.

Nothing else in the package reads ``os.environ`` for them. Read a value as an attribute,
``envs.KVSERVE_NATIVE``: each access parses the environment afresh (a test's ``monkeypatch`` or
a process's own ``os.environ`` change is seen at once; the few modules that fix a choice at
import say so). ``kvserve doctor`` lists them all with their current values (``describe()``).

Flags (``bool``) are on unless set to ``0``, the convention of every switch here. A value that
cannot be parsed raises ``ValueError`` naming the variable.

Also here: the on-disk places the variables choose, ``cache_root()`` and ``shared_dir()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def _flag(raw: str) -> bool:
    return raw.strip() != "0"


def _positive_int(raw: str) -> int:
    return max(1, int(raw))


def _zero_one(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("must be 0 or 1")
    return raw == "1"


def _act_mode(raw: str) -> str:
    mode = raw.strip().lower()
    if mode not in ("float", "int8"):
        raise ValueError("must be one of ['float', 'int8']")
    return mode


def _text(raw: str) -> str:
    return raw


@dataclass(frozen=True)
class EnvVar:
    """One declared variable.

    Attributes:
        name: ``KVSERVE_...``.
        parse: text -> value; raises ``ValueError`` on a value it refuses.
        default: the value when unset (or set empty, with ``empty_is_unset``); None: no value
            (the code chooses).
        meaning: one line for ``kvserve doctor`` and the docs.
    """

    name: str
    parse: Callable[[str], Any]
    default: Any
    meaning: str
    empty_is_unset: bool = True

    def value(self) -> Any:
        """The parsed current value, or ``default``.

        Raises:
            ValueError: the value cannot be parsed (the message names the variable).
        """
        raw = os.environ.get(self.name)
        if raw is None or (raw == "" and self.empty_is_unset):
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r}: {e}") from None


_VARS = [
    EnvVar(
        "KVSERVE_CACHE_DIR",
        _text,
        None,
        "converted models, hash memos, compiled kernels (default ~/.cache/kvserve)",
    ),
    EnvVar(
        "KVSERVE_SHARED_DIR",
        _text,
        None,
        "benchmark workloads, traces, calibration data (default <repo>/../shared)",
    ),
    EnvVar("KVSERVE_NATIVE", _flag, True, "0: never build or load the C kernels (torch paths only)"),
    EnvVar("KVSERVE_NATIVE_CFLAGS", _text, "", "extra C compiler flags for the kernel build (shell-split)"),
    EnvVar(
        "KVSERVE_NUM_THREADS",
        _positive_int,
        None,
        "torch/OpenMP threads per engine (default: calibrated at start)",
    ),
    EnvVar("KVSERVE_MALLOC_TUNE", _flag, True, "0: leave glibc malloc's mmap/trim thresholds alone"),
    EnvVar("KVSERVE_HUGE_PAGES", _flag, True, "0: no transparent-huge-page advice on packed weights"),
    EnvVar("KVSERVE_GEMM_AMX", _flag, True, "0: no AMX tiles for bfloat16 GEMMs (read at import)"),
    EnvVar("KVSERVE_ATTENTION_AMX", _flag, True, "0: no AMX tiles in the attention kernels (read at import)"),
    EnvVar("KVSERVE_QUANT_AMX", _flag, True, "0: no AMX int8 tiles in the quantized GEMMs"),
    EnvVar("KVSERVE_QUANT_VNNI", _flag, True, "0: no AVX-512 VNNI int8 dot products in the quantized GEMMs"),
    EnvVar("KVSERVE_QUANT_X4", _flag, True, "0: no 4-row interleaved weight layout for quantized decode"),
    EnvVar(
        "KVSERVE_QUANT_ACT",
        _act_mode,
        None,
        "float | int8: quantized GEMMs' activations (default: int8 with VNNI)",
    ),
    EnvVar(
        "KVSERVE_TP_SHARD_EMBEDDING",
        _zero_one,
        None,
        "0 | 1: split the embedding by vocab under TP (default: on CUDA)",
    ),
    EnvVar("KVSERVE_TP_TIMEOUT_S", float, 120.0, "seconds a tensor-parallel collective may wait for a peer"),
    # An empty key is refused by the server (it would leave it open), so it is passed on as set.
    EnvVar(
        "KVSERVE_API_KEY",
        _text,
        None,
        "the server's API key (as --api-key); never printed",
        empty_is_unset=False,
    ),
]
VARIABLES: dict[str, EnvVar] = {v.name: v for v in _VARS}

if TYPE_CHECKING:
    KVSERVE_CACHE_DIR: str | None
    KVSERVE_SHARED_DIR: str | None
    KVSERVE_NATIVE: bool
    KVSERVE_NATIVE_CFLAGS: str
    KVSERVE_NUM_THREADS: int | None
    KVSERVE_MALLOC_TUNE: bool
    KVSERVE_HUGE_PAGES: bool
    KVSERVE_GEMM_AMX: bool
    KVSERVE_ATTENTION_AMX: bool
    KVSERVE_QUANT_AMX: bool
    KVSERVE_QUANT_VNNI: bool
    KVSERVE_QUANT_X4: bool
    KVSERVE_QUANT_ACT: str | None
    KVSERVE_TP_SHARD_EMBEDDING: bool | None
    KVSERVE_TP_TIMEOUT_S: float
    KVSERVE_API_KEY: str | None


def __getattr__(name: str) -> Any:
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module 'kvserve.envs' has no attribute {name!r}")
    return var.value()


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])


def describe() -> list[dict[str, Any]]:
    """Each variable as ``{"name", "set", "value", "default", "meaning"}`` (``kvserve doctor``).

    ``value`` is the parsed current value, or the error text when it cannot be parsed; the API
    key's value is shown only as ``"<set>"``.
    """
    rows = []
    for var in _VARS:
        raw = os.environ.get(var.name)
        try:
            value: Any = var.value()
        except ValueError as e:
            value = f"invalid: {e}"
        if var.name == "KVSERVE_API_KEY" and raw:
            value = "<set>"
        rows.append(
            {
                "name": var.name,
                "set": raw is not None,
                "value": value,
                "default": var.default,
                "meaning": var.meaning,
            }
        )
    return rows


def cache_root() -> Path:
    """``$KVSERVE_CACHE_DIR`` or ``~/.cache/kvserve`` (read at each call)."""
    env = VARIABLES["KVSERVE_CACHE_DIR"].value()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvserve"


def shared_dir() -> Path:
    """``$KVSERVE_SHARED_DIR`` or ``<repo>/../shared`` (may not exist): fixed workloads, request
    traces and calibration data. Nothing at run time needs it: benchmarks, trace replay and
    cost-model refits do, and say so when it is missing."""
    env = VARIABLES["KVSERVE_SHARED_DIR"].value()
    return Path(env) if env else REPO_ROOT.parent / "shared"
