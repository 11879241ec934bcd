"""A CPU engine must not page-fault its activations afresh on every step (``cpu_malloc``).

By default glibc gives freed memory back to the OS (unmapped large blocks, a trimmed heap
top), so each step faults its activation memory in again. Measured in fresh processes (the
settings are process-wide) on a pattern that shows it deterministically: three 24 MB buffers
allocated, written and freed per "step" (glibc's dynamic mmap threshold rises to 24 MB and its
trim threshold to 48 MB; then the heap grows by 72 MB and is trimmed again on every free). The signal is the resident set size
dropping on free (memory handed back, to be faulted in again), not the fault count: this VM's
host pages out cold memory (DAMON), which adds faults of its own. With ``keep_freed_memory`` the
freed buffers must stay. Untuned glibc keeps or returns them depending on the heap's layout
(both seen run to run), so the control case that shows the test can fail is glibc told to
return memory (``MALLOC_TRIM_THRESHOLD_=0``, which ``keep_freed_memory`` then leaves alone).
And a CPU engine applies the settings by itself.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/statm") or sys.platform != "linux", reason="needs Linux and glibc"
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_STEPS = textwrap.dedent("""
    import torch
    from kvserve.worker.cpu_malloc import keep_freed_memory

    def rss_mb():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

    print(keep_freed_memory())
    drops = []
    for _ in range(6):  # (the first steps: the first mmap, then the heap grows to its working size)
        bufs = [torch.empty(6 * 2**20).fill_(1.0) for _ in range(3)]  # 24 MB each
        peak = rss_mb()
        del bufs
        drops.append(peak - rss_mb())
    print(max(drops[3:]))
""")


def _run(script: str, *args: str, **malloc_env: str) -> list:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "KVSERVE_MALLOC_TUNE"}
    env.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **malloc_env)
    r = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


def test_freed_step_buffers_stay_in_the_process():
    applied, tuned = _run(_STEPS)
    # The user's own setting wins; glibc told to always give memory back is the control case.
    skipped, returned = _run(_STEPS, MALLOC_TRIM_THRESHOLD_="0")
    assert applied == "True" and skipped == "False"
    assert _run(_STEPS, KVSERVE_MALLOC_TUNE="0")[0] == "False"
    # MB of resident memory given back to the OS when a step's 72 MB of buffers are freed
    assert float(returned) > 60, (
        f"RSS dropped by only {returned} MB with MALLOC_TRIM_THRESHOLD_=0: the test shows nothing"
    )
    assert float(tuned) < 4, f"RSS dropped by {tuned} MB on free with keep_freed_memory"


def test_cpu_engine_applies_the_malloc_settings(tiny_llama_dir):
    script = textwrap.dedent("""
        import sys
        from kvserve import LLM
        from kvserve.worker import cpu_malloc
        assert not cpu_malloc._applied
        LLM(model=sys.argv[1], device="cpu", num_gpu_blocks=16, num_cpu_blocks=0)
        print(cpu_malloc._applied)
    """)
    assert _run(script, str(tiny_llama_dir)) == ["True"]
