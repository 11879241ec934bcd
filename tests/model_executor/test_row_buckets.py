"""oneDNN GEMMs run at a bounded set of row counts (``row_buckets``), and padding changes no
result beyond bfloat16 rounding."""

import pytest
import torch

from kvserve.model_executor.layers.row_buckets import EXACT_ROWS, buckets, onednn_rows, pad_rows
from kvserve.model_executor.models import llama
from kvserve.model_executor.models.llama import linear
from kvserve.ops import gemm, gemm_amx


def test_buckets_bound_padding_and_count():
    for rows in range(1, 4097):
        b = onednn_rows(rows)
        assert b >= rows
        if rows <= EXACT_ROWS:
            assert b == rows
        else:
            assert b - rows < rows / 8, rows  # under 1/8 more rows
        assert onednn_rows(b) == b  # a bucket is its own bucket
    # 8 per doubling: 65..2048 rows meet 40 distinct counts (bounding oneDNN's primitive cache)
    assert len({onednn_rows(r) for r in range(65, 2049)}) == 40
    assert onednn_rows(65) == 72 and onednn_rows(513) == 576 and onednn_rows(2048) == 2048


def test_pad_rows_appends_zeros():
    x = torch.randn(70, 8)
    p = pad_rows(x)
    assert p.shape == (72, 8) and torch.equal(p[:70], x) and not p[70:].any()
    y = torch.randn(64, 8)
    assert pad_rows(y) is y


@pytest.mark.parametrize("rows", [17, 65, 100, 513])
def test_padded_onednn_linear_matches_float32(rows):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN not available")
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    try:
        wp = torch.ops.mkldnn._reorder_linear_weight(w, None)
    except (RuntimeError, AttributeError) as e:
        pytest.skip(f"oneDNN cannot reorder a bfloat16 weight here: {e}")
    x = torch.randn(rows, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    out = linear(x, wp, b)
    assert out.shape == (rows, 96) and out.is_contiguous()
    ref = x.float() @ w.float().T + b.float()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("lo", "hi"), [(1, 1), (2, 300), (65, 2048), (100, 130), (17, 4096)])
def test_buckets_lists_each_bucket_once(lo, hi):
    assert buckets(lo, hi) == sorted({onednn_rows(r) for r in range(lo, hi + 1)})
    assert buckets(hi + 1, hi) == []


def _onednn_from(weight, limit: int) -> int | None:
    """The fewest rows at which ``linear`` sends ``weight`` to oneDNN, None when it never does."""
    if isinstance(weight, gemm_amx.AmxWeight):
        return gemm_amx.MAX_ROWS + 1
    if isinstance(weight, gemm.PanelWeight):
        return None if weight.large is None else weight.max_rows + 1
    return 2 if getattr(weight, "is_mkldnn", False) else None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_warm_row_buckets_runs_each_onednn_gemm_a_step_can_meet(dtype, monkeypatch):
    """Every (weight shape, row bucket) a step of up to ``max_rows`` rows sends to oneDNN is run
    once, and nothing else: the LM head only up to 256 rows (sampled rows), weights on our own
    kernels (float32 panels) or left plain (float32 without AVX-512F) not at all."""
    from tests.conftest import tiny_llama_config

    cfg = tiny_llama_config(hidden_size=128, intermediate_size=256, num_attention_heads=4)
    model = llama.LlamaForCausalLM(cfg, dtype, "cpu")
    model.prepack_linear_weights()
    a, m = model.layers[0].self_attn, model.layers[0].mlp
    expected = []
    for w, limit in [
        (a.qkv_weight, 300),
        (a.o_weight, 300),
        (m.gate_up_weight, 300),
        (m.down_weight, 300),
    ] + [(model.lm_head, 256)]:
        lo = _onednn_from(w, limit)
        if lo is not None:
            expected += [(id(w), r) for r in buckets(lo, limit)]
    calls = []
    real = llama.linear
    monkeypatch.setattr(
        llama, "linear", lambda x, w, b=None: calls.append((id(w), x.shape[0])) or real(x, w, b)
    )
    assert model.warm_row_buckets(300) == len(calls)
    assert sorted(calls) == sorted(expected)
    if dtype == torch.float32:
        # our own panels at every row count (AVX-512F), or plain tensors for torch's GEMM: no
        # packed oneDNN weight to warm
        assert calls == []
    elif gemm_amx.available():  # AMX tiles up to 64 rows, oneDNN's copy above
        assert len(calls) == 4 * len(buckets(65, 300)) + len(buckets(65, 256)) == 4 * 18 + 16


_CACHE_SCRIPT = """
import kvserve  # sets the primitive cache bounds before torch loads oneDNN
import torch
from kvserve.model_executor.layers.row_buckets import buckets
from kvserve.model_executor.models.llama import linear
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # the default model's
weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).bfloat16(), None) for n, k in shapes]
for p in range(2):
    print("@@pass", p, flush=True)
    for w, (n, k) in zip(weights, shapes):
        for rows in buckets(65, 2048 if n != 49152 else 256):
            linear(torch.zeros(rows, k, dtype=torch.bfloat16), w)
"""


def test_primitive_cache_holds_every_bucket_of_the_default_models_shapes():
    """A second pass over every row bucket of the default model's GEMM shapes builds no oneDNN
    primitive again: the cache bound (``kvserve/__init__.py``) holds them all. At a bound of 256
    every one was rebuilt on each pass (a step so slowed ran 1.1x its repeats)."""
    import os
    import subprocess
    import sys

    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN not available")
    env = {
        k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "ONEDNN_VERBOSE")
    }
    env["ONEDNN_VERBOSE"] = "profile_create"
    out = subprocess.run(
        [sys.executable, "-c", _CACHE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    if out.returncode and "reorder" in out.stderr:
        pytest.skip(f"oneDNN cannot reorder a bfloat16 weight here: {out.stderr[-200:]}")
    assert out.returncode == 0, out.stderr[-2000:]
    _, first, second = out.stdout.split("@@pass")
    builds = [sum("create:cache_miss" in line for line in part.splitlines()) for part in (first, second)]
    assert builds[0] >= 5 * 16, builds  # the first pass builds them (>= one per shape and bucket)
    assert builds[1] == 0, builds
