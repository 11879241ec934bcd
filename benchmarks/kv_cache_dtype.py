"""KV-cache dtypes (``--kv-cache-dtype``): tokens that fit in a fixed KV memory, and native decode
attention time at a long context, per cache dtype.

    .venv/bin/python benchmarks/kv_cache_dtype.py [--context 4096] [--batch 8] [--out kv.json]

Tokens: ``kv_cache_memory_gib`` over ``bytes_per_block`` for a model shape (default
SmolLM2-135M's: 30 layers, 3 KV heads, head_dim 64; ``--shape L,KH,D`` for another).
Attention: ``paged_decode_attention`` for ``--batch`` single-token queries of ``--context``
keys each (blocks in a shuffled order, as a busy pool leaves them), bfloat16 queries, over a
bfloat16 cache and over each quantized cache (int8 twice: integer dot products where the CPU
has AVX-512 VNNI, and codes widened to float32); the median of ``--reps`` calls after a warm-up,
the kernels' calls interleaved. ``KVSERVE_NUM_THREADS`` sets the threads (default torch's).
Prints a table and writes the figures as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvserve import envs
from kvserve.model_executor.layers import kv_quant
from kvserve.ops import attention as paged_attention
from kvserve.worker.cache_engine import bytes_per_block

KV_DTYPES = ("bfloat16", "int8", "fp8_e4m3", "fp8_e5m2")
#: Timed kernels: (row name, cache dtype, int8 integer dot products on). ``int8 float``: the
#: same int8 cache with its codes widened to float32 (the path of CPUs without AVX-512 VNNI).
ATTENTION_ROWS = (
    ("bfloat16", "bfloat16", True),
    ("int8", "int8", True),
    ("int8 float", "int8", False),
    ("fp8_e4m3", "fp8_e4m3", True),
    ("fp8_e5m2", "fp8_e5m2", True),
)


def tokens_that_fit(gib: float, layers: int, kv_heads: int, head_dim: int, block_size: int) -> dict:
    """Tokens of a ``gib`` GiB pool per cache dtype (float32 and bfloat16 = ``auto`` for that
    model dtype)."""
    out = {}
    for name, dtype, kv in (
        ("float32", torch.float32, "auto"),
        ("bfloat16", torch.bfloat16, "auto"),
        *((k, torch.bfloat16, k) for k in KV_DTYPES[1:]),
    ):
        bpb = bytes_per_block(layers, block_size, kv_heads, head_dim, dtype, kv)
        out[name] = int(gib * 2**30 // bpb) * block_size
    return out


def _attention_inputs(
    kv: str, batch: int, context: int, kv_heads: int, group: int, head_dim: int, block_size: int
) -> tuple:
    """Arguments of one ``paged_decode_attention`` call over a ``kv`` cache (see the module doc)."""
    torch.manual_seed(0)
    nb_seq = -(-context // block_size)
    NB = batch * nb_seq
    vals = torch.randn(2, kv_heads, NB, block_size, head_dim)
    if kv == "bfloat16":
        cache = vals.to(torch.bfloat16)
    else:
        dt = kv_quant.STORAGE_DTYPES[kv]
        rows = kv_quant.quantize(vals.reshape(-1, head_dim), dt)
        cache = rows.view(2, kv_heads, NB, block_size, head_dim + 2).view(dt)
    table = torch.randperm(NB).view(batch, nb_seq).contiguous()
    kstart = torch.zeros(batch, dtype=torch.int64)
    kend = torch.full((batch,), context, dtype=torch.int64)
    q = torch.randn(batch, kv_heads, group, head_dim).to(torch.bfloat16)
    return q, cache, table, kstart, kend


def decode_attention_ms(
    batch: int, context: int, kv_heads: int, group: int, head_dim: int, block_size: int, reps: int
) -> dict[str, float]:
    """Median milliseconds of one ``paged_decode_attention`` call per row of ``ATTENTION_ROWS``,
    the rows' calls interleaved (one of each per round, after a warm-up) so that load from
    other processes falls on all of them alike."""
    inputs = {
        kv: _attention_inputs(kv, batch, context, kv_heads, group, head_dim, block_size) for kv in KV_DTYPES
    }
    rows = {name: (inputs[kv], dot) for name, kv, dot in ATTENTION_ROWS}
    times: dict[str, list[float]] = {name: [] for name in rows}
    for r in range(3 + reps):
        for name, ((q, cache, table, kstart, kend), dot) in rows.items():
            out = torch.empty_like(q)
            paged_attention.set_q8_dot(dot)
            t0 = time.perf_counter()
            paged_attention.paged_decode_attention(q, cache, table, kstart, kend, head_dim**-0.5, out=out)
            if r >= 3:
                times[name].append(time.perf_counter() - t0)
    paged_attention.set_q8_dot(True)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    p.add_argument("--shape", default="30,3,64", help="layers,kv_heads,head_dim (default SmolLM2-135M)")
    p.add_argument("--group", type=int, default=3, help="query heads per KV head")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="JSON output file")
    ns = p.parse_args(argv)
    if envs.KVSERVE_NUM_THREADS:  # as the engine's workers honour it
        torch.set_num_threads(envs.KVSERVE_NUM_THREADS)
    layers, kv_heads, head_dim = (int(x) for x in ns.shape.split(","))
    tokens = tokens_that_fit(ns.kv_cache_memory_gib, layers, kv_heads, head_dim, ns.block_size)
    print(
        f"tokens in {ns.kv_cache_memory_gib} GiB (layers {layers}, kv heads {kv_heads}, head_dim {head_dim}):"
    )
    print(f"{'cache dtype':<12} {'tokens':>10} {'x bf16':>7} {'x f32':>7}")
    for name, n in tokens.items():
        print(f"{name:<12} {n:>10} {n / tokens['bfloat16']:>7.2f} {n / tokens['float32']:>7.2f}")
    result: dict = {"tokens": tokens, "args": vars(ns), "threads": torch.get_num_threads()}
    if paged_attention.available():
        ms = decode_attention_ms(ns.batch, ns.context, kv_heads, ns.group, head_dim, ns.block_size, ns.reps)
        print(
            f"\ndecode attention, {ns.batch} queries x {ns.context} keys, {kv_heads} KV heads x "
            f"{ns.group}, head_dim {head_dim}, {torch.get_num_threads()} threads:"
        )
        print(f"{'cache dtype':<12} {'ms':>8} {'speedup':>8}")
        for name, t in ms.items():
            print(f"{name:<12} {t:>8.3f} {ms['bfloat16'] / t:>8.2f}")
        result["decode_attention_ms"] = ms
    else:
        print(f"native attention unavailable: {paged_attention.failure_reason()}")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
