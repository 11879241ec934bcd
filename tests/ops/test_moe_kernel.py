"""The native MoE kernels (``kvserve/ops/moe.py``): routing against ``fused_moe.route`` (torch),
the experts call against ``fused_moe.per_expert_loop``, in float32 and bfloat16, on the edge
cases of routing (an expert with no tokens, all tokens on one expert, top_k = E, one row, no
rows) and on sizes that take the kernel's column tails."""

from __future__ import annotations

import pytest
import torch

from kvserve.model_executor.layers import fused_moe
from kvserve.ops import moe

pytestmark = pytest.mark.skipif(not moe.available(), reason="no C compiler / KVSERVE_NATIVE=0")


def _stacks(E, H, I, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.2
    w2 = torch.randn(E, H, I, generator=g) * 0.2
    return w13.to(dtype), w2.to(dtype)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("T,E,k", [(1, 4, 1), (37, 8, 2), (64, 64, 8), (5, 8, 8)])
def test_route_equals_torch(T, E, k, renormalize):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T + E))
    w_ref, e_ref = fused_moe.route(logits, k, renormalize)
    w, e = moe.route(logits, k, renormalize)
    assert torch.equal(e, e_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)
    # bfloat16 logits (taken in float32), weights rounded as the families that multiply in bf16
    # (bfloat16 logits tie often, and torch's top-k orders ties its own way: the same weights and
    # the same chosen logits, not necessarily the same ids)
    lb = logits.bfloat16()
    w_ref, e_ref = fused_moe.route(lb, k, renormalize, torch.bfloat16)
    w, e = moe.route(lb, k, renormalize, round_bfloat16=True)
    assert torch.equal(lb.gather(1, e), lb.gather(1, e_ref))
    torch.testing.assert_close(w, w_ref.float(), rtol=0, atol=0)


def test_route_ties_go_to_the_lower_expert():
    w, e = moe.route(torch.tensor([[0.0, 1.0, 1.0, 1.0, -1.0]]), 3, renormalize=True)
    assert e.tolist() == [[1, 2, 3]]
    torch.testing.assert_close(w, torch.full((1, 3), 1 / 3))


def test_route_refuses_bad_top_k():
    with pytest.raises(ValueError, match="top_k=5 must be in"):
        moe.route(torch.zeros(2, 4), 5, renormalize=False)


CASES = [
    # T, E, k, H, I: one row; top-2; many experts; top_k = E; column tails (H, I not multiples
    # of 16: the scalar path; 64 = 48 + 16 and 96 = 2 x 48: one- and two-vector blocks)
    (1, 4, 1, 32, 24),
    (37, 8, 2, 64, 96),
    (64, 16, 4, 64, 32),
    (5, 8, 8, 48, 16),
    (23, 6, 2, 17, 5),
    (130, 4, 2, 40, 56),
]


@pytest.mark.parametrize("T,E,k,H,I", CASES)
def test_experts_equal_the_loop_float32(T, E, k, H, I):
    w13, w2 = _stacks(E, H, I, seed=T)
    g = torch.Generator().manual_seed(T + 1)
    x = torch.randn(T, H, generator=g)
    weights, experts = fused_moe.route(torch.randn(T, E, generator=g), k, renormalize=k > 1)
    ref = fused_moe.per_expert_loop(x, weights, experts, w13, w2)
    assert ref.abs().max() > 0.1
    got = moe.experts(x, weights, experts, w13, w2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the stacks k-major (as FusedMoE keeps them): read in place, the same result
    w13k, w2k = moe.k_major(w13), moe.k_major(w2)
    assert w13k.shape == w13.shape and w13k.transpose(1, 2).is_contiguous()
    assert torch.equal(moe.experts(x, weights, experts, w13k, w2k), got)


@pytest.mark.parametrize("T,E,k,H,I", CASES)
def test_experts_bfloat16(T, E, k, H, I):
    """bfloat16 in and out, float32 inside: the loop in float32 on the same (widened) values,
    rounded once, within bfloat16 rounding; and torch's bfloat16 loop within its roundings."""
    w13, w2 = _stacks(E, H, I, seed=T, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(T + 1)
    x = torch.randn(T, H, generator=g).bfloat16()
    weights, experts = fused_moe.route(torch.randn(T, E, generator=g), k, renormalize=k > 1)
    got = moe.experts(x, weights, experts, w13, w2)
    assert got.dtype == torch.bfloat16
    exact = fused_moe.per_expert_loop(x.float(), weights, experts, w13.float(), w2.float())
    scale = float(exact.abs().max())
    assert scale > 0.1
    torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-5 * scale)
    torch_bf16 = fused_moe.per_expert_loop(x, weights.bfloat16(), experts, w13, w2).float()
    assert float((got.float() - torch_bf16).abs().max()) < 0.03 * scale


def test_one_expert_takes_all_others_empty():
    """Every token on expert 3 (weight 0.75) and 5 (0.25), the other six experts empty."""
    T, E, H, I = 9, 8, 32, 16
    w13, w2 = _stacks(E, H, I, seed=3)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    experts = torch.tensor([[3, 5]] * T)
    weights = torch.tensor([[0.75, 0.25]] * T)

    def mlp(e):
        gu = x @ w13[e].T
        return (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]) @ w2[e].T

    got = moe.experts(x, weights, experts, w13, w2)
    torch.testing.assert_close(got, 0.75 * mlp(3) + 0.25 * mlp(5), rtol=1e-5, atol=1e-5)
    one = moe.experts(x, torch.ones(T, 1), torch.full((T, 1), 7), w13, w2)
    torch.testing.assert_close(one, mlp(7), rtol=1e-5, atol=1e-5)
    assert moe.experts(x[:0], weights[:0], experts[:0], w13, w2).shape == (0, H)


def test_threads_do_not_change_the_result():
    T, E, k, H, I = 50, 8, 2, 64, 96
    w13, w2 = _stacks(E, H, I)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(T, H, generator=g)
    weights, experts = fused_moe.route(torch.randn(T, E, generator=g), k, renormalize=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = moe.experts(x, weights, experts, w13, w2)
        torch.set_num_threads(2)
        two = moe.experts(x, weights, experts, w13, w2)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_bad_inputs_are_refused():
    w13, w2 = _stacks(4, 16, 8)
    x = torch.randn(3, 16)
    w = torch.full((3, 2), 0.5)
    with pytest.raises(ValueError, match=r"expert id is outside \[0, 4\)"):
        moe.experts(x, w, torch.tensor([[0, 4]] * 3), w13, w2)
    with pytest.raises(ValueError, match="do not match"):
        moe.experts(torch.randn(3, 12), w, torch.zeros(3, 2, dtype=torch.long), w13, w2)
    with pytest.raises(ValueError, match="must both be"):
        moe.experts(x, w[:, :1], torch.zeros(3, 2, dtype=torch.long), w13, w2)
    with pytest.raises(ValueError, match="need CPU float32/bfloat16"):
        moe.experts(x.double(), w, torch.zeros(3, 2, dtype=torch.long), w13.double(), w2.double())
