"""The one-call decode step (``decode_layers``, ``csrc/decode_layers.c``): for every weight format
it covers (float32 and bfloat16 panels, AMX tiles where present, the GGUF block types with float
and int8 activations) and every step regime (rows below the quantized kernels' panel threshold,
above it, above the AMX row limit) its hidden states and KV-cache writes equal the per-layer
native calls bit for bit, and equal the module path on the dequantized weights within float
tolerance; the dispatch table follows replaced weights and caches and grows its buffers; steps
with LoRA or tensor parallelism keep the per-layer path; a bad table is refused."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import random
import shutil
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.model_executor.models import cpu_decode_step, llama
from kvserve.ops import decode_layers, gemm, gemm_amx, quant
from tests.model_executor.helpers import VOCAB, ToyAllocator, ToySeq, llama_config, make_worker, save_tiny
from tests.ops.test_quant_gemm import random_kquant_blocks

pytestmark = pytest.mark.skipif(
    not decode_layers.available(), reason=f"decode_layers unavailable: {decode_layers.failure_reason()}"
)

QTYPES = tuple(quant.BLOCK_BYTES)
#: float32 panels, bfloat16 (panels or AMX tiles: whatever prepack_weight picks here), GGUF types
FORMATS = ("float32", "bfloat16", *QTYPES)
BLOCK, NUM_BLOCKS = 4, 1024


def native_here(fmt: str) -> bool:
    """Whether this file's workers run ``fmt`` on native GEMMs here (float weights: AMX tiles
    or the panels, packed wherever the kernels built, AVX2 hosts too: ``panels=True``)."""
    if fmt == "bfloat16":
        return gemm_amx.available() or gemm.available()
    if fmt == "float32":
        return gemm.available()
    return quant.available()


FORMATS_HERE = [f for f in FORMATS if native_here(f)]


def fused_max_rows(model) -> tuple[int | None, str]:
    """The most rows of a step that ``model``'s dense linear weights run natively, so that the
    one-call step applies (None: any), and why. It depends on the CPU for bfloat16
    (``linear.prepack_weight``): AMX tiles up to ``gemm_amx.MAX_ROWS`` rows, oneDNN above; no
    AMX but a bfloat16 dot product faster than the FMAs (AMD Zen 4) the panels up to
    ``gemm.BF16_DOT_MAX_ROWS``, oneDNN above; otherwise the panels at any row count."""
    w = model.layers[0].self_attn.qkv_weight
    if isinstance(w, gemm_amx.AmxWeight):
        return gemm_amx.MAX_ROWS, "bfloat16 on AMX tiles: oneDNN above gemm_amx.MAX_ROWS rows"
    if isinstance(w, gemm.PanelWeight) and w.max_rows is not None:
        return w.max_rows, (
            "bfloat16 without AMX and with a fast AVX512-BF16 dot product: oneDNN above "
            "gemm.BF16_DOT_MAX_ROWS rows"
        )
    return None, "native kernels at every row count"


@contextlib.contextmanager
def env(name: str, value: str | None):
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def random_quant(qtype: str, n: int, k: int, rng) -> quant.QuantWeight:
    """A random ``[n, k]`` weight in ``qtype`` blocks of modest magnitude."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if quant.BLOCK_WEIGHTS[qtype] == 256:
        nb = k // 256
        data = random_kquant_blocks(qtype, n, k, rng).reshape(n, nb, -1)
        # super-scales ~2e-4 (weights up to ~0.2): softmax scores far from near-ties, so the
        # float tolerance test compares like with like
        for off in (208,) if qtype == "q6_k" else (0, 2):
            d = rng.standard_normal((n, nb)) * 2e-4
            data[..., off : off + 2] = (
                (np.abs(d) if off == 2 else d).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
            )
        data = data.reshape(n, -1)
    else:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        data = quantize(w, GGMLQuantizationType[qtype.upper()])
    return quant.QuantWeight(torch.from_numpy(np.array(data)), qtype, k)


@functools.cache
def worker(fmt: str):
    """A worker on a tiny 2-layer model (hidden 256: the K-quants' superblock) whose linear
    weights are ``fmt``: the model dtype's packed weights (panels or AMX tiles, also where the
    CPU lacks AVX-512), or random GGUF blocks; every other
    format's model has q/k/v and o biases."""
    fmt, _, act_dtype = fmt.partition("@")  # "q8_0@bfloat16": GGUF blocks in a bfloat16 model
    bias = FORMATS.index(fmt) % 2 == 0
    cfg = llama_config(
        hidden_size=256,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=512,
        attention_bias=bias,
    )
    path = tempfile.mkdtemp(prefix="kvserve-native-layers-")
    atexit.register(shutil.rmtree, path, True)
    save_tiny(path, cfg, seed=3)
    dtype = act_dtype or ("bfloat16" if fmt == "bfloat16" else "float32")
    # the panels on every host with the kernels (an AVX2 host's model would keep oneDNN and
    # the module path): the one-call step over them stays tested there
    w = make_worker(path, block_size=BLOCK, num_gpu_blocks=NUM_BLOCKS, native=True, dtype=dtype, panels=True)
    if fmt in QTYPES:
        rng = np.random.default_rng(11)
        for layer in w.runner.model.layers:
            for module, name in (
                (layer.self_attn, "qkv_weight"),
                (layer.self_attn, "o_weight"),
                (layer.mlp, "gate_up_weight"),
                (layer.mlp, "down_weight"),
            ):
                old = getattr(module, name)
                module._parameters.pop(name, None)
                setattr(module, name, random_quant(fmt, old.shape[0], old.shape[1], rng))
    return w


def decode_inputs(w, rows: int, seed: int):
    """A pure-decode step of ``rows`` sequences with random cached contexts (1-40 tokens,
    random cache contents): the runner's inputs."""
    rng = random.Random(seed)
    alloc = ToyAllocator(NUM_BLOCKS, seed=seed)
    md = []
    for _ in range(rows):
        s = ToySeq([rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 40))])
        s.data.update_num_computed_tokens(s.data.get_prompt_len())
        s.data.append_token_id(rng.randrange(3, VOCAB))
        md.append(s.metadata(1, alloc, BLOCK))
    g = torch.Generator().manual_seed(seed)
    for c in w.cache_engine.gpu_cache:
        c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    return w.runner.prepare_inputs(md)


def run(w, inp, fused: bool, native: bool = True):
    """Hidden states of the step and the caches after it (the caches restored afterwards)."""
    cache = w.cache_engine.gpu_cache
    snapshot = [c.clone() for c in cache]
    cls = llama.LlamaForCausalLM
    old = (cls.fuse_native_decode, cls.use_native_decode)
    cls.fuse_native_decode, cls.use_native_decode = fused, native
    try:
        with torch.inference_mode():
            out = w.runner.model(inp.input_ids.clone(), inp.positions, cache, inp.attn)
        after = [c.clone() for c in cache]
    finally:
        cls.fuse_native_decode, cls.use_native_decode = old
        for c, s in zip(cache, snapshot):
            c.copy_(s)
    return out, after


@contextlib.contextmanager
def count_fused():
    calls: list[int] = []
    real = cpu_decode_step._StepPlan.run

    def counted(self, x, *a):
        calls.append(x.shape[0])
        return real(self, x, *a)

    cpu_decode_step._StepPlan.run = counted
    try:
        yield calls
    finally:
        cpu_decode_step._StepPlan.run = real


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=st.sampled_from(FORMATS_HERE),
    rows=st.sampled_from([1, 2, 5, 16, 23, 70]),
    act=st.sampled_from(["float", "int8"]),
    seed=st.integers(0, 2**16),
)
def test_fused_step_bit_identical_to_per_layer_calls(fmt, rows, act, seed):
    """Property: the one-call step gives the per-layer path's hidden states and cache writes
    exactly, for every format, row count (both quantized-kernel regimes, past AMX's limit) and
    activation mode (int8 forced on every ISA), with and without biases."""
    w = worker(fmt)
    with env(quant.ACT_ENV, act):
        inp = decode_inputs(w, rows, seed)
        assert inp.attn.native_decode is not None
        with count_fused() as calls:
            got, got_cache = run(w, inp, fused=True)
        want, want_cache = run(w, inp, fused=False)
    # bfloat16 past the AMX tiles' or (with a fast AVX512-BF16) the panels' row limit runs
    # oneDNN: the module path, neither native form
    limit, _ = fused_max_rows(w.runner.model)
    past_limit = limit is not None and rows > limit
    assert calls == ([] if past_limit else [rows])
    assert torch.equal(got, want), f"max diff {(got.float() - want.float()).abs().max()}"
    assert all(torch.equal(a, b) for a, b in zip(got_cache, want_cache))


@pytest.mark.skipif(not gemm_amx.available(), reason="needs AMX tiles (the route switched off here)")
def test_bfloat16_fused_step_without_the_amx_gemm(monkeypatch):
    """``KVSERVE_GEMM_AMX=0`` on an AMX host: the bfloat16 weights packed as on a CPU without
    AMX (the panels; oneDNN past their row limit where the bfloat16 dot product is fast), and
    the one-call step equal to the per-layer calls bit for bit wherever it applies."""
    monkeypatch.setattr(gemm_amx, "USE_FOR_GEMM", False)
    w = worker.__wrapped__("bfloat16")  # (a fresh worker: the cached one holds AMX tiles)
    assert isinstance(w.runner.model.layers[0].self_attn.qkv_weight, gemm.PanelWeight)
    limit, _ = fused_max_rows(w.runner.model)
    for rows in (1, 20, 70):
        inp = decode_inputs(w, rows, seed=rows)
        with count_fused() as calls:
            got, got_cache = run(w, inp, fused=True)
        want, want_cache = run(w, inp, fused=False)
        assert calls == ([] if limit is not None and rows > limit else [rows])
        assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_cache, want_cache))


@pytest.mark.skipif(not quant.available(), reason="no quantized kernels")
@pytest.mark.parametrize("qtype", quant.VNNI_TYPES)
@pytest.mark.parametrize("amx", ["1", "0"])
def test_bfloat16_quantized_fused_step_bit_identical_on_every_int8_route(qtype, amx):
    """A bfloat16 model on Q8_0 / Q4_1 weights in the int8 mode, with and without the AMX
    kernel (without: VNNI up to ``VNNI_BF16_MAX_ROWS`` rows, float panels above, where the
    kernels have VNNI): the one-call step reads the bytes of the kernel it calls and equals the
    per-layer calls at each row regime (act8, VNNI / AMX, panels)."""
    if amx == "1" and not quant.amx_supported():
        pytest.skip("needs AMX tiles (the AMX route)")
    w = worker(f"{qtype}@bfloat16")
    with env(quant.ACT_ENV, "int8"), env(quant.AMX_ENV, amx):
        picked = []
        for rows in (2, quant.VNNI_BF16_MAX_ROWS, quant.PANEL_ROWS + 4):
            picked.append(quant.pick_kernel(rows, qtype, torch.bfloat16))
            inp = decode_inputs(w, rows, seed=rows)
            with count_fused() as calls:
                got, got_cache = run(w, inp, fused=True)
            want, want_cache = run(w, inp, fused=False)
            assert calls == [rows]
            assert torch.equal(got, want), (rows, picked[-1])
            assert all(torch.equal(a, b) for a, b in zip(got_cache, want_cache))
        middle = "amx" if amx == "1" else "vnni" if quant.vnni_enabled(qtype) else "act8"
    assert picked == ["act8", middle, "amx" if amx == "1" else "panel"], picked


@pytest.mark.parametrize("fmt", ["float32", *QTYPES])
@pytest.mark.parametrize("rows", [1, 20])
def test_fused_step_matches_module_path_on_dequantized_weights(fmt, rows):
    """Float activations: the one-call step on quantized (or packed) weights equals torch's
    module path on the same weights as plain float32 tensors within float tolerance."""
    if not native_here(fmt):
        pytest.skip(f"{fmt}: no native GEMM on this host")
    w = worker(fmt)
    model = w.runner.model
    with env(quant.ACT_ENV, "float"):
        inp = decode_inputs(w, rows, seed=rows)
        with count_fused() as calls:
            got, got_cache = run(w, inp, fused=True)
        assert calls == [rows]
        names = [(layer.self_attn, n) for layer in model.layers for n in ("qkv_weight", "o_weight")]
        names += [(layer.mlp, n) for layer in model.layers for n in ("gate_up_weight", "down_weight")]
        saved = [getattr(m, n) for m, n in names]
        try:
            for (m, n), wt in zip(names, saved):
                plain = quant.dequantize(wt) if isinstance(wt, quant.QuantWeight) else wt.unpack()
                setattr(m, n, plain.float().contiguous())
            want, want_cache = run(w, inp, fused=True, native=False)
        finally:
            for (m, n), wt in zip(names, saved):
                setattr(m, n, wt)
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * scale + 1e-5, f"{fmt}: max error {err} (scale {scale})"
    for a, b in zip(got_cache, want_cache):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


def test_plan_follows_replaced_weights_and_new_cache_tensors():
    """Found by review: the dispatch table holds raw pointers, so a model whose weights were
    replaced (prepacked or quantized again) must get a new table, and a step on other cache
    tensors must write those, never the old ones."""
    w = worker("float32")
    model = w.runner.model
    inp = decode_inputs(w, 3, seed=5)
    first, _ = run(w, inp, fused=True)
    attn = model.layers[0].self_attn
    old = attn.qkv_weight
    attn.qkv_weight = gemm.PanelWeight(old.unpack() * 0.5)
    try:
        got, _ = run(w, inp, fused=True)
        want, _ = run(w, inp, fused=False)
        assert torch.equal(got, want) and not torch.equal(got, first)
    finally:
        attn.qkv_weight = old
    cache = w.cache_engine.gpu_cache
    other = [c.clone() for c in cache]
    with torch.inference_mode():
        h1 = model(inp.input_ids.clone(), inp.positions, other, inp.attn)
    assert torch.equal(h1, first)
    assert not all(torch.equal(a, b) for a, b in zip(other, cache)), "the step wrote the old caches"
    assert torch.equal(run(w, inp, fused=True)[0], first)  # back on the worker's caches


def test_buffers_grow_with_the_row_count():
    """Rows past the table's buffers (2 -> 9 -> 15 rows in one regime) regrow them; the results
    stay the per-layer path's."""
    w = worker("q8_0")
    with env(quant.ACT_ENV, "float"):
        for rows in (2, 9, 15):
            inp = decode_inputs(w, rows, seed=rows)
            got, _ = run(w, inp, fused=True)
            want, _ = run(w, inp, fused=False)
            assert torch.equal(got, want)
        plan = cpu_decode_step.step_plan(w.runner.model, 15, w.cache_engine.gpu_cache)
        assert plan is not None and plan.struct.max_rows == 16


@pytest.mark.parametrize("what", ["lora", "tp", "flag"])
def test_lora_tensor_parallel_and_flag_keep_the_per_layer_path(what, monkeypatch):
    """The boundary: steps with LoRA adapters or under tensor parallelism (Python between the
    kernels), or with ``fuse_native_decode`` off, run the per-layer calls."""
    w = worker("float32")
    model = w.runner.model
    inp = decode_inputs(w, 2, seed=1)
    seen = []
    monkeypatch.setattr(cpu_decode_step, "_forward_per_layer", lambda *a: seen.append(1) or a[1])
    if what == "lora":
        monkeypatch.setattr(inp.attn, "lora", object())
    elif what == "tp":
        monkeypatch.setattr(model, "tp", object(), raising=False)
    else:
        monkeypatch.setattr(llama.LlamaForCausalLM, "fuse_native_decode", False)
    with count_fused() as calls, torch.inference_mode():
        cpu_decode_step.forward_layers(
            model, torch.zeros(2, 256), *model.rope.lookup(inp.positions), w.cache_engine.gpu_cache, inp.attn
        )
    assert seen == [1] and calls == []


def test_step_refuses_a_bad_dispatch_table():
    """A table the C side cannot run (unknown GEMM kind, AMX on float32, rows outside
    ``[1, max_rows]``, a q norm without a k norm, Gemma layers missing a kernel, a norm or a
    window's inputs, no layers) is refused before any work: EINVAL, nothing written."""
    layer = decode_layers.DLLayer()
    for g in (layer.qkv, layer.o, layer.gate_up, layer.down):
        g.fn, g.kind = 1, decode_layers.TILE
    keep = torch.zeros(4)
    layer.cache = layer.in_norm = layer.post_norm = keep.data_ptr()
    layers = (decode_layers.DLLayer * 1)(layer)
    m = decode_layers.DLModel(num_layers=1, hidden=4, H=2, KH=1, D=2, inter=4, max_rows=4)
    m.layers = ctypes.cast(layers, ctypes.POINTER(decode_layers.DLLayer))
    out = torch.full((8, 4), 7.0)
    fn = decode_layers.step_fn(torch.float32)

    def call(T):
        return fn(ctypes.addressof(m), T, *[None] * 4, 0, None, None, keep.data_ptr(), out.data_ptr(), 1)

    for T in (0, 5):
        assert call(T) == decode_layers.EINVAL
    layers[0].o.kind = 9
    assert call(1) == decode_layers.EINVAL
    layers[0].o.kind = decode_layers.AMX  # bfloat16 only
    assert call(1) == decode_layers.EINVAL
    layers[0].o.kind = decode_layers.TILE
    layers[0].q_norm = keep.data_ptr()  # a q norm without its k norm
    assert call(1) == decode_layers.EINVAL
    layers[0].q_norm = None
    m.gemma = 1  # Gemma layers without their kernels, feedforward norms or window entries
    assert call(1) == decode_layers.EINVAL
    m.offset_rms = m.gelu = 1
    assert call(1) == decode_layers.EINVAL
    layers[0].pre_ff_norm = layers[0].post_ff_norm = keep.data_ptr()
    m.nkeys, layers[0].keys = 1, 1
    assert call(1) == decode_layers.EINVAL
    layers[0].keys = 0  # (keys[0] has no table)
    assert call(1) == decode_layers.EINVAL
    m.nkeys = decode_layers.MAX_KEYS + 1
    assert call(1) == decode_layers.EINVAL
    m.gemma = m.nkeys = 0
    layers[0].down.fn = None
    assert call(1) == decode_layers.EINVAL
    m.num_layers = 0
    assert call(1) == decode_layers.EINVAL
    assert torch.equal(out, torch.full((8, 4), 7.0))


def test_layout_check_matches_the_c_structs():
    sizes = decode_layers._LIB.fn("decode_layers_struct_sizes")
    assert [sizes(i) for i in range(5)] == [
        ctypes.sizeof(decode_layers.DLGemm),
        ctypes.sizeof(decode_layers.DLLayer),
        ctypes.sizeof(decode_layers.DLModel),
        ctypes.sizeof(decode_layers.DLLora),
        ctypes.sizeof(decode_layers.DLKeys),
    ]
    assert sizes(5) == -1


@pytest.mark.skipif(not quant.available() or quant.act8_isa() != "avx512-vnni", reason="no VNNI kernels here")
@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
def test_plans_follow_the_vnni_row_threshold_and_switch(qtype):
    """The one-call step's plans are cached per regime (``cpu_decode_step._regime``): a step of
    ``VNNI_ROWS`` to ``PANEL_ROWS - 1`` rows after one of fewer rows (and back), and a step after
    ``KVSERVE_QUANT_VNNI`` changed, must run the kernels the per-layer path picks for them (the
    VNNI kernel or not), bit for bit, not a plan built for the other side."""
    if qtype not in QTYPES:
        pytest.skip(f"{qtype} not among this file's formats")
    w = worker(qtype)
    low = quant.VNNI_ROWS[qtype]
    with env(quant.ACT_ENV, "int8"), env(quant.AMX_ENV, "0"):
        for rows, vnni in [(2, "1"), (low, "1"), (2, "1"), (low + 1, "0"), (20, "1"), (20, "0"), (low, "1")]:
            with env(quant.VNNI_ENV, vnni):
                inp = decode_inputs(w, rows, seed=rows)
                got, _ = run(w, inp, fused=True)
                want, _ = run(w, inp, fused=False)
                assert torch.equal(got, want), (rows, vnni, (got - want).abs().max())
