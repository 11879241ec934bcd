"""Checks of the simulator tools' command-line values (``kvserve simulate``, ``kvserve profile``,
``kvserve bench fidelity``).

Each check raises ``ValueError`` with a one-line message naming the flag, the limit and the value
given (``--time-scale must be a finite number >= 0, got nan``); the tools print it as
``Error: ...`` and exit with status 2, before any model is loaded or any run starts.
``given_dests`` tells which flags were typed, so a flag that the chosen mode would ignore is an
error rather than silently dropped.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

_UNSET = object()


def check_float(
    flag: str, v, *, lo: float = 0.0, lo_open: bool = True, allow_inf: bool = False, meaning: str = ""
) -> None:
    """``v`` must be a finite number above ``lo`` (``>= lo`` unless ``lo_open``); ``inf`` too
    with ``allow_inf`` (``meaning`` says what it or the bound means, in the message).

    Raises:
        ValueError: ``"<flag> must be a finite number > <lo>[ or inf], got <v>"``.
    """
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)
    if ok and math.isinf(v):
        ok = allow_inf and v > 0
    elif ok:
        ok = v > lo if lo_open else v >= lo
    if not ok:
        rule = f"a finite number {'>' if lo_open else '>='} {lo:g}" + (" or inf" if allow_inf else "")
        raise ValueError(f"{flag} must be {rule}{f' ({meaning})' if meaning else ''}, got {v!r}")


#: Latest virtual arrival time (seconds) a simulation may have: float64 seconds keep
#: sub-microsecond resolution up to here; beyond it a step's milliseconds vanish in rounding.
MAX_ARRIVAL_S = 1e9


def check_arrival_span(requests, flag: str, limit_s: float = MAX_ARRIVAL_S, why: str = "") -> None:
    """The last of ``requests``' ``arrival_s`` (seconds; None counts as 0) must be at most
    ``limit_s``.

    Raises:
        ValueError: naming ``flag`` (the setting that stretched the arrivals), the last
            arrival and the limit (``why`` says why it is there; by default the float clock).
    """
    last = max((r.arrival_s or 0.0 for r in requests), default=0.0)
    if last > limit_s:
        why = why or "float seconds keep a step's microseconds only below that"
        raise ValueError(
            f"{flag}: the last request would arrive at {last:.3g} s; at most {limit_s:.3g} s ({why})"
        )


def check_int(flag: str, v, *, lo: int = 1, hi: int | None = None, why: str = "") -> None:
    """``v`` must be an integer in ``[lo, hi]`` (``hi``: a cap, ``why`` says why it is there).

    Raises:
        ValueError: ``"<flag> must be an integer >= <lo>[ and <= <hi>], got <v>"``.
    """
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rule = f"an integer >= {lo}" + ("" if hi is None else f" and <= {hi:,}")
        raise ValueError(f"{flag} must be {rule}{f' ({why})' if why else ''}, got {v!r}")


def flag_of(dest: str) -> str:
    """``num_gpu_blocks`` -> ``--num-gpu-blocks``."""
    return "--" + dest.replace("_", "-")


def given_dests(ap: argparse.ArgumentParser, argv: list[str] | None, ns: argparse.Namespace) -> set[str]:
    """The destinations of the flags ``argv`` sets explicitly (whatever their values), parsed
    again by ``ap`` (which already accepted ``argv`` as ``ns``) onto a namespace where every
    field is already set, so argparse fills in no defaults."""
    probe = argparse.Namespace(**{k: _UNSET for k in vars(ns)})
    ap.parse_args(argv, namespace=probe)
    return {k for k, v in vars(probe).items() if v is not _UNSET}


def refuse_unused(given: AbstractSet[str], dests: Iterable[str], why: str) -> None:
    """Raise when a flag the current mode ignores was given.

    Raises:
        ValueError: ``"--flag[, --flag] <why>"`` naming each given one of ``dests``.
    """
    bad = [flag_of(d) for d in dests if d in given]
    if bad:
        raise ValueError(f"{', '.join(bad)} {why}")
