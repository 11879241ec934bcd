"""Keep a CPU engine's freed step buffers in the heap instead of returning them to the OS.

A prefill step allocates and frees large activation buffers (the fused gate/up output alone is
tokens x 2 x intermediate size per layer). By default glibc gives freed
memory back to the OS: blocks over its *dynamic* mmap threshold (128 KiB, raised to the largest
block freed so far, at most 32 MiB) are unmapped on free, and free memory at the top of the
heap beyond the dynamic trim threshold (twice the mmap threshold) is trimmed. So each step
page-faults much of its activation memory in again, each minor fault zeroing a 4 KiB page.
vLLM's CPU backend avoids the same cost by preloading tcmalloc.

``keep_freed_memory()`` fixes the mmap threshold at glibc's maximum (32 MiB: larger blocks are
still mapped and unmapped) and the trim threshold at 1 GiB, so freed blocks stay in the heap for
the next step: the steady state has next to no page faults per step, at the same peak RSS.
Both are ``mallopt(3)`` settings (glibc manual, "Malloc Tunable Parameters"). Setting either
disables glibc's dynamic adjustment of both, which is why they go together: the trim threshold
alone would leave the mmap threshold at 128 KiB and make every larger block an mmap.

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


def return_freed_memory() -> bool:
    """Give the heap's free pages back to the OS now (glibc's ``malloc_trim(0)``), as after a
    large free that should show in the resident set (sleep mode): the trim threshold above keeps
    them otherwise.

    Returns:
        True when glibc released some memory; False when it released none or the C library has
        no ``malloc_trim`` (not glibc).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))
