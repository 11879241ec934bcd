"""Micro benchmark of prefill attention: the native kernel (``kvserve.ops.prefill_attention``, one call
per layer for all chunks, K/V read from the paged cache) against the torch path of
``PagedAttention.forward`` (one ``scaled_dot_product_attention`` per chunk, fresh K/V of chunks
starting at position 0; with ``--context`` the chunks follow cached context, so the torch path
gathers the cache through the block table and passes a bool mask, as for chunked prefill).

Default shape: one step of SmolLM2-135M prefill, 11 chunks of ~190 tokens (2,048 rows),
9 query heads / 3 KV heads, head_dim 64, block size 16, 30 calls (the layers) per pass, shuffled
block tables. Both paths run alternately in one process; the table gives the minimum and median
time of a pass, and GFLOP/s of causal attention work (``4 * D * H * sum over rows of attended
keys``, i.e. ``~4 * sum(n_i^2) / 2 * D * H`` from position 0).

    python benchmarks/attention_prefill_micro.py                     # float32 and bfloat16
    python benchmarks/attention_prefill_micro.py --dtype bfloat16 --context 256 --json-out a.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch
import torch.nn.functional as F

from kvserve.ops import prefill_attention as npa


def chunk_lengths(n: int, total: int, seed: int):
    """``n`` lengths of about ``total / n`` (+-10 %) summing to ``total``."""
    g = torch.Generator().manual_seed(seed)
    w = 0.9 + 0.2 * torch.rand(n, generator=g)
    lens = (w / w.sum() * total).floor().long()
    lens[-1] += total - int(lens.sum())
    return [int(x) for x in lens]


def setup(lens, ctx: int, H: int, KH: int, D: int, BS: int, dtype, seed: int = 0):
    """Queries (a view of a fused q/k/v buffer, as in the model), the fresh K/V, a cache with
    every chunk's context and own K/V written, and both paths' per-step metadata."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    qkv = torch.randn(T, (H + 2 * KH) * D, generator=g).to(dtype)
    q = qkv[:, : H * D].view(T, H, D)
    k = qkv[:, H * D : (H + KH) * D].view(T, KH, D)
    v = qkv[:, (H + KH) * D :].view(T, KH, D)
    nblk = [(ctx + n - 1) // BS + 1 for n in lens]
    NB = sum(nblk) + 1
    perm = torch.randperm(NB, generator=g)
    cache = torch.randn(2, KH, NB, BS, D, generator=g).to(dtype)
    table = torch.zeros(len(lens), max(nblk), dtype=torch.int64)
    used, start, chunks = 0, 0, []
    for c, (n, nb) in enumerate(zip(lens, nblk)):
        table[c, :nb] = perm[used : used + nb]
        pos = torch.arange(ctx, ctx + n)
        slots = table[c, pos // BS] * BS + pos % BS
        cache[0].view(KH, -1, D)[:, slots] = k[start : start + n].transpose(0, 1)
        cache[1].view(KH, -1, D)[:, slots] = v[start : start + n].transpose(0, 1)
        kp = torch.arange(ctx + n)
        mask = (kp[None, :] <= pos[:, None]) if ctx else None
        chunks.append((start, start + n, table[c, :nb], mask))
        used += nb
        start += n
    q_start = torch.tensor([0] + lens).cumsum(0)
    pos0 = torch.full((len(lens),), ctx, dtype=torch.int64)
    return q, k, v, cache, (table, q_start, pos0, torch.zeros(len(lens), dtype=torch.int64)), chunks


def torch_path(q, k, v, cache, chunks, scale, out):
    """What ``PagedAttention.forward`` does per chunk (one layer)."""
    KH, BS, D = cache.shape[1], cache.shape[3], cache.shape[4]
    G = q.shape[1] // KH
    for a, b, tbl, mask in chunks:
        qs = q[a:b].transpose(0, 1).unsqueeze(0)
        if mask is None:
            ks, vs = k[a:b].transpose(0, 1).unsqueeze(0), v[a:b].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=G > 1)
        else:
            L = mask.shape[1]
            gi = (torch.arange(2 * KH)[:, None] * cache.shape[2] + tbl[None, :]).reshape(-1)
            gk = cache.view(-1, BS * D).index_select(0, gi).view(2, KH, -1, D)
            o = F.scaled_dot_product_attention(
                qs,
                gk[0, :, :L].unsqueeze(0),
                gk[1, :, :L].unsqueeze(0),
                attn_mask=mask,
                scale=scale,
                enable_gqa=G > 1,
            )
        out[a:b] = o[0].transpose(0, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    ap.add_argument("--chunks", type=int, default=11)
    ap.add_argument("--tokens", type=int, default=2048, help="rows in the step (sum of chunk lengths)")
    ap.add_argument("--context", type=int, default=0, help="cached tokens before every chunk")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=30, help="calls per pass")
    ap.add_argument("--reps", type=int, default=3, help="alternating passes")
    ap.add_argument("--threads", type=int, default=0, help="torch (and kernel) threads; 0 = torch's default")
    ap.add_argument(
        "--no-amx", action="store_true", help="bfloat16 on the kernel's AVX-512 path, not AMX tiles"
    )
    ap.add_argument("--json-out", help="write the table as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    npa.USE_AMX = not args.no_amx
    if not npa.available():
        sys.exit(f"native prefill attention unavailable: {npa.failure_reason()}")
    H, KH, D, BS = args.heads, args.kv_heads, args.head_dim, args.block_size
    lens = chunk_lengths(args.chunks, args.tokens, 0)
    scale = D**-0.5
    keys = sum(args.context + i + 1 for n in lens for i in range(n))  # attended keys, all rows
    flops = 4 * D * H * keys * args.layers
    results = []
    print(
        f"chunks {lens}, context {args.context}, H {H}, KH {KH}, D {D}, BS {BS}, {args.layers} calls per pass, "
        f"{torch.get_num_threads()} threads, bfloat16 on {'AMX' if npa.USE_AMX and npa.amx_available() else 'AVX-512'}"
    )
    print(
        f"{'dtype':>9} {'torch min/med ms':>17} {'GFLOP/s':>8} {'native min/med ms':>18} {'GFLOP/s':>8} "
        f"{'speedup (median)':>17} {'max |diff|':>10}"
    )
    for name in args.dtype:
        dtype = getattr(torch, name)
        q, k, v, cache, meta, chunks = setup(lens, args.context, H, KH, D, BS, dtype)
        out_t = torch.empty(q.shape, dtype=dtype)
        out_n = torch.empty(q.shape, dtype=dtype)
        with torch.inference_mode():
            torch_path(q, k, v, cache, chunks, scale, out_t)  # warm-up (and the comparison)
            npa.paged_prefill_attention(q, cache, *meta, scale, out=out_n)
            diff = float((out_t.float() - out_n.float()).abs().max())
            tt, tn = [], []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                for _ in range(args.layers):
                    torch_path(q, k, v, cache, chunks, scale, out_t)
                tt.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for _ in range(args.layers):
                    npa.paged_prefill_attention(q, cache, *meta, scale, out=out_n)
                tn.append(time.perf_counter() - t0)
        row = dict(
            dtype=name,
            torch_min_ms=1e3 * min(tt),
            torch_med_ms=1e3 * statistics.median(tt),
            native_min_ms=1e3 * min(tn),
            native_med_ms=1e3 * statistics.median(tn),
            torch_gflops=flops / statistics.median(tt) / 1e9,
            native_gflops=flops / statistics.median(tn) / 1e9,
            speedup=statistics.median(tt) / statistics.median(tn),
            max_abs_diff=diff,
        )
        results.append(row)
        print(
            f"{name:>9} {row['torch_min_ms']:>8.1f}/{row['torch_med_ms']:<8.1f} {row['torch_gflops']:>8.1f} "
            f"{row['native_min_ms']:>9.1f}/{row['native_med_ms']:<8.1f} {row['native_gflops']:>8.1f} "
            f"{row['speedup']:>17.2f} {diff:>10.2e}"
        )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                dict(
                    chunks=lens,
                    context=args.context,
                    heads=H,
                    kv_heads=KH,
                    head_dim=D,
                    block_size=BS,
                    layers=args.layers,
                    threads=torch.get_num_threads(),
                    bf16_amx=bool(npa.USE_AMX and npa.amx_available()),
                    results=results,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
