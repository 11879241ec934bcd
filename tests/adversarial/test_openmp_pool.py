"""The engine thread must not share the machine with the main thread's idle OpenMP workers.

``openmp_pool.release_calling_thread_pool`` frees the calling thread's libgomp pool (see its
module doc: with more managed threads than CPUs libgomp stops spinning between parallel
regions, which cost the threaded server ~30% of its CPU step time). Checked in a fresh process
by the observable effect: the pool's worker threads exit.
"""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = textwrap.dedent("""
    import os, time, torch
    from kvserve.worker.openmp_pool import release_calling_thread_pool

    def threads():
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    x = torch.randn(1 << 22)
    for _ in range(3):
        x.exp()  # a parallel region: libgomp starts 1 worker for the main thread
    before = threads()
    ok = release_calling_thread_pool()
    # the workers exit asynchronously: wait for it (bounded) instead of guessing how long
    deadline = time.monotonic() + 60
    while threads() >= before and time.monotonic() < deadline:
        time.sleep(0.01)
    print(ok, before, threads())
""")


@pytest.mark.skipif(
    not os.path.exists("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="needs Linux /proc and 2 CPUs"
)
def test_release_frees_the_main_threads_openmp_workers():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OMP_NUM_THREADS", None)
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    ok, before, after = r.stdout.split()
    assert ok == "True"
    assert int(after) == int(before) - 1, f"threads {before} -> {after}: the OpenMP worker did not exit"


def test_async_engine_start_releases_the_callers_pool(monkeypatch):
    import asyncio

    from kvserve.engine import async_llm_engine

    calls = []
    monkeypatch.setattr(async_llm_engine, "release_calling_thread_pool", lambda: calls.append(1) or True)

    class _Idle:  # an engine with nothing to do
        def has_unfinished_requests(self):
            return False

        def dead_reason(self):
            return None

    async def run():
        eng = async_llm_engine.AsyncLLMEngine(_Idle())
        eng.start()
        eng.shutdown()

    asyncio.run(run())
    assert calls == [1]
