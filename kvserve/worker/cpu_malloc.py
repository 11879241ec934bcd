"""Keep a CPU engine's freed step buffers in the heap instead of returning them to the OS.

A prefill step allocates and frees a few hundred MB of activations (a 2,048-token SmolLM2 step:
the fused gate/up output alone is 12.6 MB per layer in bfloat16). By default glibc gives freed
memory back to the OS: blocks over its *dynamic* mmap threshold (128 KiB, raised to the largest
block freed so far, at most 32 MiB) are unmapped on free, and free memory at the top of the
heap beyond the dynamic trim threshold (twice the mmap threshold) is trimmed. So each step
page-faults much of its activation memory in again: 5-40k minor faults per step of SmolLM2-135M
on this project's 2-core VM (each fault zeroes a 4 KiB page). vLLM's CPU backend avoids the
same cost by preloading tcmalloc.

``keep_freed_memory()`` fixes the mmap threshold at glibc's maximum (32 MiB: larger blocks are
still mapped and unmapped) and the trim threshold at 1 GiB, so freed blocks stay in the heap for
the next step: faults per step went to ~0, peak RSS unchanged (2.6 GB, bfloat16, w64 prompts).
Both are ``mallopt(3)`` settings (glibc manual, "Malloc Tunable Parameters"). Setting either
disables glibc's dynamic adjustment of both, which is why they go together: the trim threshold
alone made every block over 128 KiB an mmap (150k faults per step).

The environment wins: nothing is changed when ``KVSERVE_MALLOC_TUNE=0`` or when the user set
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or a ``glibc.malloc`` tunable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from kvserve import envs

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: glibc's largest allowed mmap threshold on 64-bit (HEAP_MAX_SIZE / 2), bytes.
MMAP_THRESHOLD_BYTES = 32 * 2**20
#: Free memory (bytes) at the top of the heap before glibc gives it back.
TRIM_THRESHOLD_BYTES = 2**30

_applied = False


def keep_freed_memory() -> bool:
    """Apply the two ``mallopt`` settings once per process (idempotent).

    Returns:
        True when they are in effect (applied now or before); False when the environment
        opts out or the C library has no ``mallopt`` (not glibc).
    """
    global _applied
    if _applied:
        return True
    if (
        not envs.KVSERVE_MALLOC_TUNE
        or "MALLOC_MMAP_THRESHOLD_" in os.environ
        or "MALLOC_TRIM_THRESHOLD_" in os.environ
        or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")
    ):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    return _applied
