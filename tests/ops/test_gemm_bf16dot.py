"""``gemm_bf16dot``: the AVX512-BF16 dot-product GEMM against float64 sums of the same bfloat16
values, its bit-exact instruction semantics, and the dispatch that decides, from the CPU's
flags and the VDPBF16PS probe, where bfloat16 linear layers run."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvserve.ops.cpu
from kvserve.model_executor.layers import linear
from kvserve.ops import gemm, gemm_amx, gemm_bf16dot
from tests.golden import hf_greedy_logits

REPO = Path(__file__).resolve().parents[2]
needs_kernel = pytest.mark.skipif(not gemm_bf16dot.available(), reason="no AVX512-BF16 build/CPU")

U32 = 2.0**-24  # float32 unit roundoff (round to nearest)
U_BF16 = 2.0**-8  # bfloat16's (8 significant bits)


def _bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 exact result and the elementwise error bound of the kernel.

    Each product of two bfloat16 values is exact in float32 (8 + 8 significant bits). The K
    products (and the bias) are summed in float32 from 0, one rounding per addition, K in all:
    ``|s - y| <= g * A`` with ``g = K u / (1 - K u)``, ``u = 2^-24`` and ``A`` the sum of the
    terms' magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 4.4).
    The output is ``s`` rounded once to bfloat16: ``+ 2^-8 |s| <= 2^-8 (|y| + g A)``. (Denormal
    flushing adds at most 2^-126 per term: nothing at these magnitudes.)"""
    xd, wd = x.double(), w.double()
    y = xd @ wd.T
    a = xd.abs() @ wd.abs().T
    if b is not None:
        y = y + b.double()
        a = a + b.double().abs()
    k = x.shape[1]
    g = k * U32 / (1 - k * U32)
    return y, U_BF16 * (y.abs() + g * a) + g * a + 1e-30


def _emulate(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, fused_pair: bool) -> torch.Tensor:
    """The kernel's exact arithmetic in torch float32: per input-feature pair, VDPBF16PS adds the
    odd product, then the even one (Intel SDM, VDPBF16PS), each addition rounded to float32
    (``fused_pair``: the pair's sum, exact in float64, added with one rounding instead); then
    the bias; then one rounding to bfloat16."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in range(0, x.shape[1], 2):
        odd = xf[:, k + 1, None] * wf[None, :, k + 1] if k + 1 < x.shape[1] else None
        even = xf[:, k, None] * wf[None, :, k]
        if fused_pair:
            pair = even.double() + (0 if odd is None else odd.double())
            acc = (acc.double() + pair).float()
        else:
            acc = acc if odd is None else acc + odd
            acc = acc + even
    if b is not None:
        acc = acc + b.float()
    return acc.bfloat16()


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 300),
    n=st.integers(1, 200).filter(lambda n: n % 16 != 0),
    k=st.integers(1, 700),
    bias=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_within_the_float32_summation_bound(m, n, k, bias, threads, seed):
    """Ragged tails everywhere: rows past a multiple of 8 (balanced blocks), columns not a
    multiple of 16 or 48 (a padded last panel), odd K (the last pair half empty)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = gemm_bf16dot.DotWeight(w)
    assert packed.pairs.shape == (-(-n // 48), -(-k // 2), 48, 2)
    assert torch.equal(packed.unpack(), w)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = gemm_bf16dot.linear(x, packed, b)
    finally:
        torch.set_num_threads(old)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    ref, bound = _bound(x, w, b)
    err = (got.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max()):.3f}"


@needs_kernel
@pytest.mark.parametrize("m,n,k", [(3, 50, 7), (17, 100, 64), (9, 49, 101), (40, 96, 33), (1, 1, 1)])
def test_bit_exact_instruction_semantics(m, n, k):
    """The summation order is what the bound assumes, to the bit: the kernel equals a float32
    emulation of VDPBF16PS pair by pair (Intel's two roundings per pair, or one for a CPU
    that adds the pair's exact sum), bias, bfloat16 rounding."""
    g = torch.Generator().manual_seed(m * 7 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    for b in (None, torch.randn(n, generator=g).bfloat16()):
        got = gemm_bf16dot.linear(x, gemm_bf16dot.DotWeight(w), b)
        assert torch.equal(got, _emulate(x, w, b, False)) or torch.equal(got, _emulate(x, w, b, True))


@needs_kernel
def test_a_row_is_bit_identical_whatever_the_row_count():
    """A row's sums never depend on the call's other rows (row blocks, chunks, prefetches)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 577, generator=g).bfloat16()
    x = torch.randn(530, 577, generator=g).bfloat16()  # two row chunks of ~512 KB at K = 577
    packed = gemm_bf16dot.DotWeight(w)
    full = gemm_bf16dot.linear(x, packed)
    for m in (1, 5, 9, 17, 64, 455):
        assert torch.equal(gemm_bf16dot.linear(x[:m], packed), full[:m]), m
    assert torch.equal(gemm_bf16dot.linear(x[529:], packed), full[529:])


@needs_kernel
@pytest.mark.parametrize("k", [2049, 4101, 8192])
def test_k_blocked_steps_equal_unblocked_rows_and_the_float64_bound(k):
    """Past 2,048 input features a step of more than 8 rows runs each panel one K slice at a
    time (float32 sums carried between slices); a step of up to 8 rows does not. Both give a
    row the same bits (1-8 rows against 9, 17, 136), within the float64 bound, and the odd last
    feature (k = 2049, 4101) is counted once."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(100, k, generator=g).bfloat16()
    x = torch.randn(136, k, generator=g).bfloat16()
    b = torch.randn(100, generator=g).bfloat16()
    packed = gemm_bf16dot.DotWeight(w)
    full = gemm_bf16dot.linear(x, packed, b)
    for m in (1, 8, 9, 17):
        assert torch.equal(gemm_bf16dot.linear(x[:m], packed, b), full[:m]), m
    assert torch.equal(gemm_bf16dot.linear(x[130:], packed, b), full[130:])
    ref, bound = _bound(x, w, b)
    assert bool(((full.double() - ref).abs() <= bound).all())


@needs_kernel
def test_rounds_like_torch_and_edge_shapes():
    w = torch.tensor([[1.0, 2.0, 0.5], [3.0, -1.0, 0.25]], dtype=torch.bfloat16)
    x = torch.tensor([[1.0, 1.0, 1.0], [2.0, 0.0, 4.0]], dtype=torch.bfloat16)
    packed = gemm_bf16dot.DotWeight(w)
    assert torch.equal(gemm_bf16dot.linear(x, packed), torch.nn.functional.linear(x, w))
    assert gemm_bf16dot.linear(torch.empty(0, 3, dtype=torch.bfloat16), packed).shape == (0, 2)
    b = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    empty = gemm_bf16dot.DotWeight(torch.empty(2, 0, dtype=torch.bfloat16))
    assert torch.equal(gemm_bf16dot.linear(torch.empty(4, 0, dtype=torch.bfloat16), empty, b), b.expand(4, 2))
    xt = torch.randn(3, 5).bfloat16().T  # [5, 3], not contiguous
    assert torch.equal(gemm_bf16dot.linear(xt, packed), gemm_bf16dot.linear(xt.contiguous(), packed))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="DotWeight"):
        gemm_bf16dot.DotWeight(torch.randn(4, 4))
    with pytest.raises(ValueError, match="DotWeight"):
        gemm_bf16dot.DotWeight(torch.randn(4).bfloat16())
    packed = gemm_bf16dot.DotWeight(torch.randn(10, 4).bfloat16())
    with pytest.raises(ValueError, match="bf16dot linear"):
        gemm_bf16dot.linear(torch.randn(3, 5).bfloat16(), packed)
    with pytest.raises(ValueError, match="bf16dot linear"):
        gemm_bf16dot.linear(torch.randn(3, 4), packed)  # float32 x
    with pytest.raises(ValueError, match="bf16dot linear"):
        gemm_bf16dot.linear(torch.randn(3, 4).bfloat16(), packed, torch.randn(9).bfloat16())


@needs_kernel
def test_probe_measures_the_dot_product_against_fmas():
    """A throughput ratio: positive, and well inside (0.1, 10) on any real CPU (0.47-0.51 on this
    project's Xeon, ~2 where VDPBF16PS issues like an FMA)."""
    speed = gemm_bf16dot.dot_speed()
    assert 0.1 < speed < 10, speed


@pytest.fixture
def avx512_no_amx(monkeypatch):
    """An AVX-512 CPU without AMX (``cpu.has_avx512f`` is read once, at import: claimed here
    as the tests' ``cpu_flags`` claims avx512f)."""
    monkeypatch.setattr(gemm_amx, "available", lambda: False)
    monkeypatch.setattr(kvserve.ops.cpu, "has_avx512f", True)


@pytest.mark.skipif(not gemm.available(), reason="no C compiler")
@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_dispatch_follows_the_flags_and_the_probe(monkeypatch, avx512_no_amx, speed):
    """Without AVX512-BF16, or with a VDPBF16PS slower than FMAs: the panels for every step, one
    copy; with a fast one: the dot-product GEMM for every step, one copy; ``kvserve doctor``
    names what ``prepack_weight`` picks."""
    from kvserve.entrypoints import doctor

    w = torch.randn(96, 64).bfloat16()
    monkeypatch.setattr(gemm_bf16dot, "built", lambda: True)
    monkeypatch.setattr(gemm_bf16dot, "dot_speed", lambda: speed)
    monkeypatch.setattr(kvserve.ops.cpu, "cpu_flags", lambda: {"avx512f"})
    assert not gemm_bf16dot.available() and gemm.packs_bfloat16()
    packed = linear.prepack_weight(w)
    assert isinstance(packed, gemm.PanelWeight) and packed.large is None and packed.max_rows is None
    flags = {"avx512f", "avx512_bf16"}
    monkeypatch.setattr(kvserve.ops.cpu, "cpu_flags", lambda: flags)
    assert gemm_bf16dot.available() and gemm_bf16dot.dot_beats_fma() == (speed > gemm_bf16dot.DOT_FAST)
    packed = linear.prepack_weight(w)
    text = doctor._paths(flags)["linear"]["bfloat16"]
    assert "every step size" in text and f"{speed:.2f}x" in text, text
    if speed < gemm_bf16dot.DOT_FAST:
        assert isinstance(packed, gemm.PanelWeight) and packed.large is None and packed.takes(4096)
        assert "panel GEMM" in text, text
    else:
        assert isinstance(packed, gemm_bf16dot.DotWeight)
        assert "dot-product GEMM" in text and "one copy" in text, text
        assert torch.equal(packed.unpack(), w)
    for m in (1, 17, 100):
        x = torch.randn(m, 64).bfloat16()
        ref, bound = _bound(x, w, None)
        # the panels' sums are float32 in another order: the same bound holds
        assert bool(((linear.linear(x, packed).double() - ref).abs() <= bound).all()), m


@pytest.mark.skipif(not gemm.available(), reason="no C compiler")
def test_an_unbuilt_kernel_keeps_onednn(monkeypatch, avx512_no_amx):
    """AVX512-BF16 on the CPU but a build without it (an older compiler): the speed is unknown,
    so steps past BF16_DOT_MAX_ROWS keep oneDNN's copy, as before this kernel."""
    monkeypatch.setattr(kvserve.ops.cpu, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    monkeypatch.setattr(gemm_bf16dot, "built", lambda: False)
    assert not gemm_bf16dot.available() and not gemm_bf16dot.dot_beats_fma()
    assert not gemm.packs_bfloat16()
    packed = linear.prepack_weight(torch.randn(96, 64).bfloat16())
    assert isinstance(packed, gemm.PanelWeight) and packed.max_rows == gemm.BF16_DOT_MAX_ROWS


_AVX2_CHECK = """
import torch
from kvserve.ops import gemm_bf16dot as d
assert d._LIB.available(), d._LIB.failure_reason()
assert not d.built() and not d.available() and d.dot_speed() == 0.0
try:
    d.linear(torch.ones(2, 4).bfloat16(), d.DotWeight(torch.ones(3, 4).bfloat16()))
except RuntimeError as e:
    assert "not built" in str(e)
else:
    raise AssertionError("linear ran without the kernel")
print("ok")
"""


def test_a_build_without_avx512_bf16_loads_and_reports_it():
    """Built for AVX2 only (the -Werror AVX2 build of test_csrc): the library loads, says the
    kernel is absent, and ``linear`` refuses instead of running a stub."""
    import os
    import shutil

    from kvserve.ops import library
    from tests.ops import native_builds

    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    if os.environ.get(library.EXTRA_CFLAGS_ENV) or "asan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("a sanitizer run (its own flags)")
    flags = native_builds.WERROR_FLAGS["x86-64-v3"]
    failed = native_builds.build([flags], ["gemm_bf16dot.c"])[flags]
    assert not failed, failed
    r = subprocess.run(
        [sys.executable, "-c", _AVX2_CHECK],
        env=native_builds.env(flags),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


#: a bfloat16 near-tie (as tests/lora/test_lora_bf16_golden.py): our token's reference logit
#: this close to the reference's best one, or one bfloat16 step below it (the reference's logits
#: are bfloat16: 0.0625 apart at 8-16); both sides round differently in bfloat16
BF16_NEAR_TIE = 0.05
MAX_NEW = 12


@pytest.mark.skipif(not gemm.available(), reason="no C compiler")
@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_tiny_llama_bfloat16_greedy_equals_transformers(tiny_llama_dir, monkeypatch, avx512_no_amx, speed):
    """A tiny random Llama in bfloat16 (one 110-row prefill step, then 6-row decodes): greedy
    tokens equal transformers' bfloat16 ones up to bfloat16 near-ties, with the panels at every
    step (a slow VDPBF16PS, this project's Xeon) and with the dot-product GEMM at every step (a
    fast one: AMD Zen 4)."""
    from transformers import AutoModelForCausalLM

    from kvserve import LLM, SamplingParams

    monkeypatch.setattr(kvserve.ops.cpu, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    monkeypatch.setattr(gemm_bf16dot, "built", lambda: True)
    monkeypatch.setattr(gemm_bf16dot, "dot_speed", lambda: speed)
    rows: list[int] = []
    dot_rows: list[int] = []
    real, real_dot = gemm.linear, gemm_bf16dot.linear
    monkeypatch.setattr(gemm, "linear", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
    monkeypatch.setattr(gemm_bf16dot, "linear", lambda x, *a: dot_rows.append(x.shape[0]) or real_dot(x, *a))
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (6, 21, 13, 34, 9, 27)]
    refs = [hf_greedy_logits(ref_model, p, MAX_NEW) for p in prompts]
    llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="bfloat16")
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    compared = 0
    for o, (tokens, logits) in zip(outs, refs):
        ours = o.outputs[0].token_ids
        assert len(ours) == len(tokens)
        k = next((i for i, (a, b) in enumerate(zip(ours, tokens)) if a != b), len(tokens))
        if k < len(tokens):
            gap = float(logits[k].max() - logits[k][ours[k]])
            best = float(logits[k].max())
            ulp = 2.0 ** (math.floor(math.log2(abs(best))) - 7) if best else 0.0  # bfloat16 spacing
            assert gap <= max(BF16_NEAR_TIE, ulp), f"step {k}: ours {ours[k]}, ref {tokens[k]}, gap {gap:.4f}"
        compared += k
    assert compared >= 0.75 * MAX_NEW * len(prompts), compared  # near-ties are rare
    # the dispatch took effect: the panels where the dot product is slow, the dot-product GEMM
    # (the 110-row prefill step included) where it is fast
    if speed < gemm_bf16dot.DOT_FAST:
        assert rows and max(rows) > gemm.BF16_DOT_MAX_ROWS and not dot_rows, (rows, dot_rows)
    else:
        assert dot_rows and max(dot_rows) > gemm.BF16_DOT_MAX_ROWS and not rows, (rows, dot_rows)
