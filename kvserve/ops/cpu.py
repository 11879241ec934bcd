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


_FLAGS = cpu_flags()
#: What this CPU can run (read once at import), for the kernel paths that need it and the tests
#: whose premise depends on it (``pytest.mark.skipif(not cpu.has_avx512_vnni, ...)``). A
#: kernel path also needs the build (``-march=native``) and, for AMX, Linux's grant of the tile
#: state (``gemm_amx.available()``): these say only what the CPU reports.
has_avx2 = "avx2" in _FLAGS and "fma" in _FLAGS
has_avx512f = "avx512f" in _FLAGS
#: AVX-512 VNNI with AVX512BW (the int8 dot products of ``csrc/quant_dot8.h``, ``quant_vnni.h``).
has_avx512_vnni = "avx512_vnni" in _FLAGS and "avx512bw" in _FLAGS
#: AVX512-BF16 (``VDPBF16PS``, the bfloat16 conversions of ``csrc/kv_vec.h``).
has_avx512_bf16 = "avx512_bf16" in _FLAGS
#: AMX tiles with bfloat16 and int8 products (``csrc/amx_gemm.c``, ``quant_amx.h``, attention).
has_amx = {"amx_tile", "amx_bf16", "amx_int8"} <= _FLAGS
