"""The host CPU as ``/proc/cpuinfo`` describes it (Linux; elsewhere the fallbacks below)."""

from __future__ import annotations

import platform


def cpuinfo_field(name: str) -> str | None:
    """The value of the first ``name`` line of ``/proc/cpuinfo`` (e.g. ``"flags"``), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``avx512f``, ``amx_tile``, ...); empty when unknown."""
    return set((cpuinfo_field("flags") or "").split())


def cpu_model() -> str:
    """The CPU's model name."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown"
