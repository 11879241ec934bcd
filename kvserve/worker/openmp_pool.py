"""Release the calling thread's OpenMP worker threads before another thread takes over compute.

torch's CPU kernels and kvserve's native kernels share one OpenMP runtime, torch's bundled GNU
libgomp. libgomp keeps a pool of worker threads per thread that starts parallel regions, and
when it manages more threads than there are CPUs it stops spinning between regions
("throttled" spin count, ~1,000 iterations instead of ~300,000): every parallel region then
wakes its workers through the kernel. So once the main thread has run parallel work (model load,
thread calibration, warm-up) and the engine steps in a second thread (``AsyncLLMEngine``), the
main thread's idle pool tips a machine with few CPUs into the throttled mode, which slows
every short parallel region (small GEMMs, elementwise kernels) of each step.

``release_calling_thread_pool()`` calls ``omp_pause_resource(omp_pause_soft, host device)``
(OpenMP 5.0, section 3.2.43), which in libgomp frees the calling thread's pool; the count drops back and the
engine thread's workers spin again. If the calling thread later runs parallel work, libgomp
builds a new pool (correct, only slower again).
"""

from __future__ import annotations

import ctypes
import re

#: ``omp_pause_soft`` of ``omp_pause_resource_t`` (OpenMP 5.0).
OMP_PAUSE_SOFT = 1


def _loaded_libgomp() -> str | None:
    """Path of the libgomp this process has mapped (torch's bundled one), or None."""
    try:
        with open("/proc/self/maps") as f:
            m = re.search(r"\S*/libgomp[^/\s]*\.so[^/\s]*", f.read())
    except OSError:
        return None
    return m.group(0) if m else None


def release_calling_thread_pool() -> bool:
    """Free the calling thread's idle OpenMP workers (libgomp only; a no-op elsewhere).

    Returns:
        True when libgomp accepted the pause; False when no libgomp is loaded (another OpenMP
        runtime, or not Linux) or it refused (called inside a parallel region).
    """
    import torch  # noqa: F401  (torch loads the libgomp its kernels use)

    path = _loaded_libgomp()
    if path is None:
        return False
    try:
        lib = ctypes.CDLL(path)
        pause, host = lib.omp_pause_resource, lib.omp_get_initial_device
    except (OSError, AttributeError):
        return False
    pause.argtypes = [ctypes.c_int, ctypes.c_int]
    # The host device only: pausing "all" could also start libgomp's offload plugins.
    return pause(OMP_PAUSE_SOFT, host()) == 0
