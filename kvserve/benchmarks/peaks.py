"""This host's measured peaks: GEMM throughput per dtype and streaming memory bandwidth, the two
numbers a roofline floor (``kvserve.sim.roofline``) divides by.

Each GEMM row times ``y = x @ W^T`` (``x`` ``[M, K]``, ``W`` ``[N, K]``, 2 ``M N K`` FLOPs; int8:
integer operations) on square shapes with random operands, the best of calls spread over
three rounds that take every row in turn (after a warm-up), on kvserve's own kernels where they exist (``ops.gemm`` panels for float32 and
bfloat16 widened to float32, ``ops.gemm_bf16dot`` on AVX512-BF16, ``ops.quant`` Q8_0 weights on
the AVX-512 VNNI int8 kernel) and on torch (``torch.matmul``; int8: ``torch._int_mm``, torch's
int8 x int8 -> int32 product, as ``matmul`` of int8 tensors wraps around in int8). A dtype's
peak is its best row. Bandwidth rows stream a tensor larger than any last-level cache:
``sum`` and kvserve's ``quant.stream_read`` read it, a ``copy_`` reads and writes it (counted as
both, shown for reference); the peak is the best read.

``load_or_measure`` caches the full measurement in ``<cache_root>/roof/`` keyed by CPU model,
thread count, torch and kvserve versions, so the benchmarks that report a fraction of the roof
measure it once per host.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: GEMM shapes ``(M, N, K)`` of a full measurement: large enough that packing and dispatch
#: vanish beside the multiply-adds (2,048 gives no more on a 2-core host), short enough per
#: call (a few milliseconds) that on a busy host some calls find the cores free.
SHAPES = ((512, 512, 512), (1024, 1024, 1024))
QUICK_SHAPES = ((512, 512, 512),)
#: Bytes streamed by a bandwidth row (full / quick): past a last-level cache (4x a 32 MiB L3),
#: a few milliseconds per pass, so that on a busy host some passes find the cores free.
STREAM_BYTES = 128 * 2**20
QUICK_STREAM_BYTES = 64 * 2**20
#: Which measured dtype's peak a weight storage type runs at (quantized weights: int8 products).
PEAK_DTYPE = {
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "bfloat16",
    "q8_0": "int8",
    "q4_1": "int8",
}


@dataclass
class Peaks:
    """A host's measured peaks.

    Attributes:
        cpu: CPU model name; flags: its relevant feature flags; threads: threads used;
        torch: torch version; quick: whether measured with the quick (small) settings.
        gemm: rows ``{dtype, backend, shape: [M, N, K], gflops}`` (GFLOP/s, 1e9).
        bandwidth: rows ``{method, gb_per_s, read_only}`` (GB/s, 1e9 bytes).
    """

    cpu: str
    flags: list[str]
    threads: int
    torch: str
    quick: bool = False
    gemm: list[dict] = field(default_factory=list)
    bandwidth: list[dict] = field(default_factory=list)

    def peak_flops(self, dtype: str) -> float:
        """The best GEMM rate (FLOP/s) measured for ``dtype`` (``float32``, ``bfloat16``,
        ``int8``, or a weight type of ``PEAK_DTYPE``); float32's where none was measured.

        Raises:
            ValueError: no GEMM row at all.
        """
        want = PEAK_DTYPE.get(dtype, dtype)
        rows = [r["gflops"] for r in self.gemm if r["dtype"] == want] or [
            r["gflops"] for r in self.gemm if r["dtype"] == "float32"
        ]
        if not rows:
            raise ValueError("no GEMM peak was measured")
        return max(rows) * 1e9

    def peak_bandwidth(self) -> float:
        """The best streaming-read rate (bytes/s).

        Raises:
            ValueError: no read was measured.
        """
        rows = [r["gb_per_s"] for r in self.bandwidth if r["read_only"]]
        if not rows:
            raise ValueError("no memory bandwidth was measured")
        return max(rows) * 1e9

    def as_dict(self) -> dict:
        return asdict(self)


def relevant_flags() -> list[str]:
    """The CPU's flags that decide its GEMM peaks (``ops.cpu.cpu_flags``)."""
    from kvserve.ops.cpu import cpu_flags

    keep = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_")
    return sorted(f for f in cpu_flags() if f.startswith(keep))


#: Seconds of calls per row in each round (full / quick), and the rounds: every round calls
#: every row in turn, so each row's calls are spread over the whole measurement and a burst of
#: other processes' work on a shared host slows some of its calls, not all of them.
BUDGET_S = 0.1
QUICK_BUDGET_S = 0.05
ROUNDS = 3


def _best_s(fn: Callable[[], object], reps: int, budget_s: float = 0.0) -> float:
    """The fastest of at least ``reps`` calls of ``fn`` (seconds), more while ``budget_s`` lasts
    (at most 100)."""
    best = float("inf")
    start = time.perf_counter()
    for i in range(100):
        if i >= reps and time.perf_counter() - start > budget_s:
            break
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _interleaved_best_s(
    calls: list[Callable[[], object]], rounds: int, reps: int, budget_s: float
) -> list[float | Exception]:
    """Each call's fastest time over ``rounds`` rounds of ``_best_s(call, reps, budget_s)``,
    the calls taken in turn within a round, after one warm-up call each (packing caches,
    primitive creation, page faults); a call that raises gives its exception instead."""
    best: list[float | Exception] = []
    for fn in calls:
        try:
            fn()
            best.append(float("inf"))
        except (RuntimeError, ValueError) as e:  # a kernel this build or torch lacks
            best.append(e)
    for _ in range(rounds):
        for i, fn in enumerate(calls):
            b = best[i]
            if isinstance(b, float):
                best[i] = min(b, _best_s(fn, reps, budget_s))
    return best


def _gemm_candidates(m: int, n: int, k: int) -> list[tuple[str, str, Callable[[], object]]]:
    """``(dtype, backend, call)`` of every GEMM this host runs for one shape (operands built
    here, once)."""
    import torch

    from kvserve.ops import gemm, gemm_bf16dot, quant

    g = torch.Generator().manual_seed(0)
    w32 = torch.randn(n, k, generator=g)
    x32 = torch.randn(m, k, generator=g)
    wt32 = w32.t().contiguous()
    out: list[tuple[str, str, Callable[[], object]]] = [("float32", "torch.matmul", lambda: x32 @ wt32)]
    if gemm.available():
        p32 = gemm.PanelWeight(w32)
        out.append(("float32", "kvserve gemm panels", lambda: gemm.linear(x32, p32)))
    xb, wtb = x32.bfloat16(), wt32.bfloat16()
    out.append(("bfloat16", "torch.matmul", lambda: xb @ wtb))
    if gemm.available():
        pb = gemm.PanelWeight(w32.bfloat16())
        out.append(("bfloat16", "kvserve gemm panels (fp32 FMAs)", lambda: gemm.linear(xb, pb)))
    if gemm_bf16dot.available():
        db = gemm_bf16dot.DotWeight(w32.bfloat16())
        out.append(("bfloat16", "kvserve bf16dot", lambda: gemm_bf16dot.linear(xb, db)))
    xi = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    wi = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=g)
    out.append(("int8", "torch._int_mm", lambda: torch._int_mm(xi, wi)))
    if quant.available() and quant.act8_isa() == "avx512-vnni" and k % quant.BLOCK_ELEMS == 0:
        q8 = quant.quantize_q8_0(w32)
        out.append(("int8", "kvserve quant vnni (Q8_0)", lambda: quant.linear(x32, q8, kernel="vnni")))
    return out


def measure_gemm(
    shapes=SHAPES,
    reps: int = 1,
    budget_s: float = BUDGET_S,
    log: Callable[[str], None] | None = None,
    rounds: int = ROUNDS,
) -> list[dict]:
    """One row per (shape, dtype, backend): the best rate of its calls (GFLOP/s; int8: GOP/s)."""
    rows = [
        (shape, dtype, backend, fn) for shape in shapes for dtype, backend, fn in _gemm_candidates(*shape)
    ]
    times = _interleaved_best_s([fn for *_, fn in rows], rounds, reps, budget_s)
    out = []
    for ((m, n, k), dtype, backend, _), secs in zip(rows, times):
        if isinstance(secs, Exception):
            if log:
                log(f"skipped {dtype} {backend} {m}x{n}x{k}: {secs}")
            continue
        out.append(
            {"dtype": dtype, "backend": backend, "shape": [m, n, k], "gflops": 2.0 * m * n * k / secs / 1e9}
        )
    return out


def measure_bandwidth(
    nbytes: int = STREAM_BYTES, reps: int = 1, budget_s: float = BUDGET_S, rounds: int = ROUNDS
) -> list[dict]:
    """Streaming rates (GB/s) over a float32 tensor of ``nbytes``: ``sum`` (read), kvserve's
    ``quant.stream_read`` (read, where the kernels load), ``copy_`` (read + write, counted as
    both)."""
    import torch

    from kvserve.ops import quant

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    threads = torch.get_num_threads()
    # (method, bytes moved per call, read only, call)
    rows: list[tuple[str, int, bool, Callable[[], object]]] = [("torch sum (read)", nbytes, True, src.sum)]
    if quant.available():
        rows.append(("kvserve stream_read (read)", nbytes, True, lambda: quant.stream_read(src, threads)))
    rows.append(("torch copy_ (read + write)", 2 * nbytes, False, lambda: dst.copy_(src)))
    times = _interleaved_best_s([r[3] for r in rows], rounds, reps, budget_s)
    return [
        {"method": name, "gb_per_s": moved / secs / 1e9, "read_only": ro}
        for (name, moved, ro, _), secs in zip(rows, times)
        if isinstance(secs, float)
    ]


def measure(quick: bool = False, log: Callable[[str], None] | None = None) -> Peaks:
    """Measure this host's peaks at torch's current thread count (``quick``: one small shape,
    fewer calls, a smaller stream: a rough figure in about a second)."""
    import torch

    from kvserve.ops.cpu import cpu_model

    peaks = Peaks(cpu_model(), relevant_flags(), torch.get_num_threads(), torch.__version__, quick)
    budget, rounds = (QUICK_BUDGET_S, 1) if quick else (BUDGET_S, ROUNDS)
    peaks.gemm = measure_gemm(QUICK_SHAPES if quick else SHAPES, 2, budget, log, rounds)
    peaks.bandwidth = measure_bandwidth(QUICK_STREAM_BYTES if quick else STREAM_BYTES, 2, budget, rounds)
    return peaks


def cache_path(threads: int) -> Path:
    """The cache file of this host's peaks at ``threads`` threads (key: CPU model, threads,
    torch and kvserve versions)."""
    import torch

    import kvserve
    from kvserve import envs
    from kvserve.ops.cpu import cpu_model

    key = f"{cpu_model()}|{threads}|{torch.__version__}|{kvserve.__version__}"
    return envs.cache_root() / "roof" / f"peaks-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def load_or_measure(
    remeasure: bool = False,
    quick: bool = False,
    log: Callable[[str], None] | None = None,
    threads: int | None = None,
) -> tuple[Peaks, bool]:
    """This host's peaks at ``threads`` threads (default: torch's current count) and whether
    they came from the cache.

    A cached full measurement is used unless ``remeasure``; otherwise they are measured
    (``quick``: the small settings, not cached; a full measurement is written to the cache).
    torch's thread count is set to ``threads`` while measuring and restored after: an engine
    may have lowered it (``worker.calibrate_threads`` picks 1 on busy cores), while the roof is
    the host's, at the count the benchmark started with."""
    import torch

    before = torch.get_num_threads()
    threads = threads or before
    path = cache_path(threads)
    if not remeasure and path.is_file():
        try:
            return Peaks(**json.loads(path.read_text())), True
        except (ValueError, TypeError):  # a damaged or older file: measure again
            pass
    torch.set_num_threads(threads)
    try:
        peaks = measure(quick, log)
    finally:
        torch.set_num_threads(before)
    if not quick:
        from kvserve.workload.io import write_text_atomic

        write_text_atomic(path, json.dumps(peaks.as_dict(), indent=1))
    return peaks, False
