"""The one-call decode step (``csrc/decode_layers.c``) over an int8 KV cache: ``rope_write_kv_q8``
quantizes each new k / v row into its slot and the int8 decode attention kernel reads the
codes and scales in place. Its hidden states and cache writes equal the per-layer native calls
bit for bit, and the torch reference path (k / v quantized by ``kv_quant.quantize``, the cache
gathered, dequantized and attended by SDPA) within float tolerance."""

from __future__ import annotations

import atexit
import functools
import random
import shutil
import tempfile

import pytest
import torch

from kvserve.model_executor.layers import kv_quant
from kvserve.model_executor.models import llama
from kvserve.ops import decode_layers, gemm
from tests.model_executor.helpers import VOCAB, ToyAllocator, ToySeq, llama_config, make_worker, save_tiny
from tests.model_executor.test_cpu_decode_step_fused import count_fused, fused_max_rows

pytestmark = pytest.mark.skipif(
    not (decode_layers.available() and gemm.available()),
    reason=f"decode_layers or the panels unavailable: {decode_layers.failure_reason()}",
)

BLOCK, NUM_BLOCKS = 4, 512


@functools.cache
def worker(dtype: str):
    """A worker on a tiny 2-layer model (head_dim 64, GQA 2) with an int8 KV cache, its weights
    on the panels (the one-call step's kernels on every host with them)."""
    cfg = llama_config(
        hidden_size=256,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
    )
    path = tempfile.mkdtemp(prefix="kvserve-int8-decode-")
    atexit.register(shutil.rmtree, path, True)
    save_tiny(path, cfg, seed=5)
    return make_worker(
        path,
        block_size=BLOCK,
        num_gpu_blocks=NUM_BLOCKS,
        native=True,
        dtype=dtype,
        panels=True,
        kv_cache_dtype="int8",
    )


def decode_inputs(w, rows: int, seed: int, native: bool = True):
    """A pure-decode step of ``rows`` sequences with cached contexts of distinct lengths (1-39
    tokens) whose cache rows are quantized random values (codes and valid scales): the runner's
    inputs (``native`` False: the torch path's, whose rows are ordered by context length)."""
    rng = random.Random(seed)
    alloc = ToyAllocator(NUM_BLOCKS, seed=seed)
    md = []
    for n in rng.sample(range(1, 40), rows):  # distinct lengths: a row is known by its position
        s = ToySeq([rng.randrange(3, VOCAB) for _ in range(n)])
        s.data.update_num_computed_tokens(s.data.get_prompt_len())
        s.data.append_token_id(rng.randrange(3, VOCAB))
        md.append(s.metadata(1, alloc, BLOCK))
    g = torch.Generator().manual_seed(seed)
    for c in w.cache_engine.gpu_cache:
        D = c.shape[-1] - kv_quant.SCALE_BYTES
        c.copy_(
            kv_quant.quantize(torch.randn(c.numel() // c.shape[-1], D, generator=g), c.dtype).view(c.shape)
        )
    w.runner.use_native = native
    try:
        return w.runner.prepare_inputs(md)
    finally:
        w.runner.use_native = True


def run(w, inp, fused: bool):
    """Hidden states of the step and the caches after it (the caches restored afterwards)."""
    cache = w.cache_engine.gpu_cache
    snapshot = [c.clone() for c in cache]
    cls = llama.LlamaForCausalLM
    old = cls.fuse_native_decode
    cls.fuse_native_decode = fused
    try:
        with torch.inference_mode():
            out = w.runner.model(inp.input_ids.clone(), inp.positions, cache, inp.attn)
        after = [c.clone() for c in cache]
    finally:
        cls.fuse_native_decode = old
        for c, s in zip(cache, snapshot):
            c.copy_(s)
    return out, after


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 5, 23])
def test_one_call_step_bit_identical_to_per_layer_calls(dtype, rows):
    w = worker(dtype)
    assert w.cache_engine.gpu_cache[0].dtype == torch.int8
    limit, why = fused_max_rows(w.runner.model)
    if limit is not None and rows > limit:
        pytest.skip(why)
    inp = decode_inputs(w, rows, seed=rows)
    assert inp.attn.native_decode is not None
    with count_fused() as calls:
        got, got_cache = run(w, inp, fused=True)
    assert calls == [rows]  # the one-call step ran, on the int8 cache
    want, want_cache = run(w, inp, fused=False)
    assert torch.equal(got, want), f"max diff {(got.float() - want.float()).abs().max()}"
    assert all(torch.equal(a, b) for a, b in zip(got_cache, want_cache))
    before = [c.clone() for c in w.cache_engine.gpu_cache]
    assert not all(torch.equal(a, b) for a, b in zip(got_cache, before)), "nothing was written"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_call_step_matches_the_torch_reference_path(dtype):
    """The reference: the module path without native kernels (torch rotary, ``kv_quant.quantize``
    on write, gathered rows dequantized, SDPA). The written rows agree to one code step (the
    rotary's float rounding may move a value across a rounding boundary) and the hidden states
    within float tolerance (bfloat16: its rounding of the attention output)."""
    w = worker(dtype)
    rows = 6
    inp = decode_inputs(w, rows, seed=11)
    with count_fused() as calls:
        got, got_cache = run(w, inp, fused=True)
    assert calls == [rows]
    ref_inp = decode_inputs(w, rows, seed=11, native=False)
    assert ref_inp.attn.native_decode is None and ref_inp.attn.decode_buckets
    cls = llama.LlamaForCausalLM
    old = cls.use_native_decode
    cls.use_native_decode = False
    try:
        with torch.inference_mode(), _no_native_rope():
            want, want_cache = run(w, ref_inp, fused=False)
    finally:
        cls.use_native_decode = old
    for a, b in zip(got_cache, want_cache):
        da, db = (kv_quant.dequantize(x, torch.int8, torch.float32) for x in (a, b))
        step = b[..., -kv_quant.SCALE_BYTES :].view(torch.float16).float().max()
        assert (da - db).abs().max() <= 1.01 * step
    # the torch path orders its single-token rows by context length
    order = [int((ref_inp.positions == p).nonzero()) for p in inp.positions]
    want = want[order]
    scale = want.float().abs().max()
    tol = 1e-4 if dtype == "float32" else 2e-2
    assert (got.float() - want.float()).abs().max() <= tol * scale


class _no_native_rope:
    """The module path's rotary and cache write in torch (``elementwise.writes_cache`` False)."""

    def __enter__(self):
        from kvserve.ops import elementwise

        self._real = elementwise.writes_cache
        elementwise.writes_cache = lambda *a: False
        return self

    def __exit__(self, *exc):
        from kvserve.ops import elementwise

        elementwise.writes_cache = self._real
