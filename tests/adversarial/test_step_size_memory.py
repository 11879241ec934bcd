"""A long-running CPU engine must not grow its memory with every new step size.

Each step runs the model's GEMMs on as many rows as it has tokens, and a server sees
ever-new token counts. oneDNN (bfloat16 GEMMs, and float32 ones of weights prepacked by
``prepack_weight``) creates and caches one primitive per distinct row count and weight shape,
~0.7 MB each, by default up to 1024 per cache: the process grew by ~1 GB over a few hundred
distinct prefill lengths of a tiny model. ``linear.linear`` pads rows to a few buckets
(``row_buckets``) and ``kvserve/__init__.py`` bounds the caches.

Measured in a fresh process, so that primitives cached by earlier tests cannot hide the growth,
with glibc told to return freed memory (``MALLOC_TRIM_THRESHOLD_=0``, a fixed mmap threshold):
otherwise the allocator also keeps freed buffers of a bfloat16 run (with a bound of 64 entries:
129 MB grown, 47 MB with the allocator settings).
"""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.model_executor.helpers import llama_config, save_tiny

pytestmark = [
    pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc"),
    pytest.mark.slow,
]

#: Steps of distinct token counts 2..N+1, and the growth allowed over them (the warm-up's
#: allocations are already in place). With oneDNN's default cache sizes: float32 418 MB,
#: bfloat16 415 MB; with kvserve's bound of 128 entries: 56 MB and 78 MB; with row buckets:
#: bfloat16 54 MB at any bound from 128 to 1,024 (float32's native kernels: under 1 MB).
N = 200
LIMIT_MB = 150

_SCRIPT = textwrap.dedent("""
    import sys, torch
    from kvserve.model_executor.model_loader import load_model
    from kvserve.worker.model_runner import ModelRunner
    from tests.model_executor.helpers import ToyAllocator, ToySeq

    def rss_mb():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

    model = load_model(sys.argv[1], getattr(torch, sys.argv[3]), "cpu")
    runner = ModelRunner(model, 4, 64, None, sampler=None)

    def step(T):
        md = [ToySeq(list(range(3, 3 + T))).metadata(T, ToyAllocator(64), 4)]
        inp = runner.prepare_inputs(md)
        with torch.inference_mode():
            h = model(inp.input_ids, inp.positions, None, inp.attn)
            model.compute_logits(h[-(T % 8 + 1):])

    for T in (2, 7, 64, 201):  # warm-up: buffers of every size below in place
        step(T)
    r0 = rss_mb()
    for T in range(2, int(sys.argv[2]) + 2):  # (one token without a cache is a decode)
        step(T)
    print(rss_mb() - r0)
""")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_memory_does_not_grow_with_distinct_step_sizes(tmp_path, dtype):
    save_tiny(tmp_path, llama_config())
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(
        os.environ,
        PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
        MALLOC_TRIM_THRESHOLD_="0",
        MALLOC_MMAP_THRESHOLD_="131072",
    )
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path), str(N), dtype],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    grew = float(r.stdout.split()[-1])
    assert grew < LIMIT_MB, f"RSS grew by {grew:.0f} MB over {N} distinct step sizes"
