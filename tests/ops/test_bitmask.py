"""Structured-output mask kernels (``bitmask_kernel``) against the torch path: masking in place
and the fused masked greedy sampler, on ragged vocabularies (V % 32 != 0), masks shorter than the
vocabulary, all-zero / all-one / sparse / dense masks and rows mixing constrained and free."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_executor.layers.bitmask import allowed_tokens, apply_token_bitmask_torch_, bitmask_words
from kvserve.ops import bitmask as bitmask_kernel
from kvserve.ops import elementwise

pytestmark = pytest.mark.skipif(not bitmask_kernel.available(), reason="native bitmask kernels not built")


def _mask(kind: str, rows: int, words: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "zeros":
        return torch.zeros(rows, words, dtype=torch.int32)
    if kind == "ones":
        return torch.full((rows, words), -1, dtype=torch.int32)
    bits = torch.randint(0, 2**32, (rows, words), generator=gen, dtype=torch.int64)
    if kind == "sparse":  # a few allowed tokens, most words all-zero
        keep = torch.rand(rows, words, generator=gen) < 0.05
        bits = torch.where(keep, bits & torch.randint(0, 2**32, (rows, words), generator=gen), 0)
    elif kind == "dense":  # most words all-one, a few holes
        hole = torch.rand(rows, words, generator=gen) < 0.1
        bits = torch.where(hole, bits, 2**32 - 1)
    return (bits - (bits >= 2**31).long() * 2**32).to(torch.int32)


def _torch_masked_greedy(logits, bitmask, mask_rows):
    ref = logits.clone()
    rows = (mask_rows >= 0).nonzero().flatten()
    if len(rows):
        apply_token_bitmask_torch_(ref, rows, bitmask[mask_rows[rows]])
    tok = ref.argmax(dim=-1)
    lp = ref.gather(1, tok.unsqueeze(1)).squeeze(1) - ref.logsumexp(dim=-1)
    return ref, tok, lp


CASES = [
    (v, w_delta, kind)
    for v in (1, 31, 32, 33, 100, 1000, 49152)
    for w_delta in (0, -1)
    for kind in ("random", "zeros", "ones", "sparse", "dense")
]


@pytest.mark.parametrize("vocab,w_delta,kind", CASES)
def test_apply_token_bitmask_equals_torch(vocab, w_delta, kind):
    gen = torch.Generator().manual_seed(vocab * 7 + len(kind))
    words = max(0, bitmask_words(vocab) + w_delta)  # -1: tokens past 32 * W are not allowed
    logits = torch.randn(6, vocab, generator=gen)
    rows = torch.tensor([4, 0, 5], dtype=torch.int64)
    bitmask = _mask(kind, 3, words, gen)
    ref = logits.clone()
    apply_token_bitmask_torch_(ref, rows, bitmask)
    got = logits.clone()
    bitmask_kernel.apply_token_bitmask_(got, rows, bitmask)
    assert torch.equal(got, ref)
    # every row at once (rows=None)
    full = _mask(kind, 6, words, gen)
    ref, got = logits.clone(), logits.clone()
    apply_token_bitmask_torch_(ref, None, full)
    bitmask_kernel.apply_token_bitmask_(got, None, full)
    assert torch.equal(got, ref)
    assert torch.equal(torch.isinf(got), ~allowed_tokens(full, vocab))


@pytest.mark.parametrize("vocab,w_delta,kind", CASES)
def test_greedy_sample_masked_equals_masking_then_greedy(vocab, w_delta, kind):
    gen = torch.Generator().manual_seed(vocab * 11 + len(kind))
    words = max(0, bitmask_words(vocab) + w_delta)
    logits = torch.randn(7, vocab, generator=gen)
    bitmask = _mask(kind, 4, words, gen)
    mask_rows = torch.tensor([2, -1, 0, 3, -1, 1, 0], dtype=torch.int64)
    before = logits.clone()
    tok, lp = bitmask_kernel.greedy_sample_masked(logits, bitmask, mask_rows)
    assert torch.equal(logits, before), "the fused path must not write the logits"
    ref, rtok, rlp = _torch_masked_greedy(logits, bitmask, mask_rows)
    some = ~torch.isinf(ref).all(dim=1)
    assert torch.equal(tok[some], rtok[some])
    torch.testing.assert_close(lp[some], rlp[some], rtol=1e-5, atol=1e-5)
    # a row with nothing allowed: token 0 and NaN, as argmax + logsumexp of all -inf
    assert tok[~some].eq(0).all() and lp[~some].isnan().all()
    if elementwise.available():  # the unfused kernel on the masked rows agrees
        t2, l2 = elementwise.greedy_sample(ref)
        assert torch.equal(t2[some], tok[some])
        torch.testing.assert_close(l2[some], lp[some], rtol=1e-6, atol=1e-6)


def test_greedy_sample_masked_ties_go_to_the_lowest_allowed_index():
    logits = torch.zeros(2, 70)
    logits[:, [3, 40, 69]] = 5.0
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 1] = 1 << 8  # token 40
    bitmask[0, 2] = 1 << 5  # token 69
    bitmask[1, 0] = 1 << 3  # token 3, and all of word 1: tokens 32..63 (40 is one of them)
    bitmask[1, 1] = -1
    tok, lp = bitmask_kernel.greedy_sample_masked(logits, bitmask, torch.tensor([0, 1]))
    assert tok.tolist() == [40, 3]
    expected = torch.tensor([-math.log(2.0), -math.log(2 + 31 * math.exp(-5.0))])
    torch.testing.assert_close(lp, expected)


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(1, 300),
    rows=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(["random", "zeros", "ones", "sparse", "dense"]),
)
def test_masked_kernels_match_torch_on_random_shapes(vocab, rows, seed, kind):
    gen = torch.Generator().manual_seed(seed)
    words = bitmask_words(vocab)
    logits = torch.randn(rows, vocab, generator=gen)
    logits[torch.rand(rows, vocab, generator=gen) < 0.2] = 1.0  # ties
    bitmask = _mask(kind, rows, words, gen)
    mask_rows = torch.randint(-1, rows, (rows,), generator=gen)
    tok, lp = bitmask_kernel.greedy_sample_masked(logits, bitmask, mask_rows)
    ref, rtok, rlp = _torch_masked_greedy(logits, bitmask, mask_rows)
    some = ~torch.isinf(ref).all(dim=1)
    assert torch.equal(tok[some], rtok[some])
    torch.testing.assert_close(lp[some], rlp[some], rtol=1e-5, atol=1e-5)
    got = logits.clone()
    bitmask_kernel.apply_token_bitmask_(got, None, bitmask)
    ref2 = logits.clone()
    apply_token_bitmask_torch_(ref2, None, bitmask)
    assert torch.equal(got, ref2)


def test_bad_arguments_are_value_errors():
    logits = torch.randn(3, 64)
    mask = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32 bitmask"):
        bitmask_kernel.apply_token_bitmask_(logits, None, mask.long())
    with pytest.raises(ValueError, match="float32 logits"):
        bitmask_kernel.apply_token_bitmask_(logits.double(), None, mask)
    with pytest.raises(ValueError, match="2 mask rows for 3"):
        bitmask_kernel.apply_token_bitmask_(logits, None, mask)
    with pytest.raises(ValueError, match="out of range"):
        bitmask_kernel.apply_token_bitmask_(logits, torch.tensor([0, 3]), mask)
    with pytest.raises(ValueError, match="row index"):
        bitmask_kernel.greedy_sample_masked(logits, mask, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="out of range"):
        bitmask_kernel.greedy_sample_masked(logits, mask, torch.tensor([0, 1, 2]))
    assert not bitmask_kernel.supported(logits.t(), mask)
