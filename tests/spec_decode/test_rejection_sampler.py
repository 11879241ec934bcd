"""Rejection sampler: emitted tokens are distributed as the target's, whatever the draft.

Distribution checks are chi-square goodness-of-fit tests over many independent rows of one
batched call (each row one trial), at significance 1e-4 against tabulated critical values (so a
correct sampler fails about once in 10,000 runs; the draws are seeded, so a run is repeatable).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.spec_decode.rejection_sampler import rejection_sample

# Upper 1e-4 quantiles of the chi-square distribution, by degrees of freedom (standard tables;
# e.g. scipy.stats.chi2.ppf(1 - 1e-4, df)).
CHI2_CRIT_1E4 = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513, 5: 25.745, 6: 27.856, 7: 29.878}

N = 40_000  # rows (trials) per distribution check
V = 6
K = 3


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of integer counts ``observed[V]`` against ``probs[V]`` over the
    categories with positive probability; asserts none falls where the probability is 0."""
    n = int(observed.sum())
    probs = probs.double()
    support = probs > 0
    assert int(observed[~support].sum()) == 0, f"tokens drawn outside the support: {observed.tolist()}"
    expected = probs[support] * n
    stat = float(((observed[support].double() - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def assert_matches(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=probs.shape[0])
    stat, df = chi_square(counts, probs)
    if df == 0:
        return  # a point mass: the support check above is the whole test
    assert stat < CHI2_CRIT_1E4[df], f"chi2={stat:.1f} (df={df}) counts={counts.tolist()} p={probs.tolist()}"


def random_dist(gen: torch.Generator, zeros: int = 0) -> torch.Tensor:
    w = torch.rand(V, generator=gen, dtype=torch.float64) + 0.05
    if zeros:
        w[torch.randperm(V, generator=gen)[:zeros]] = 0.0
    return (w / w.sum()).float()


def run(p: torch.Tensor, q: torch.Tensor | None, seed: int):
    """N rows with target ``p [K+1, V]`` and drafts drawn from ``q [K, V]`` (or, for ``q`` None,
    a fixed point-mass draft ``[0, 1, 2]``)."""
    torch.manual_seed(seed)
    target = p.unsqueeze(0).expand(N, -1, -1).contiguous()
    if q is None:
        drafts = torch.tensor([[0, 1, 2]]).expand(N, -1).contiguous()
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[i], N, replacement=True) for i in range(K)], dim=1)
        draft_probs = q.unsqueeze(0).expand(N, -1, -1).contiguous()
    tokens, num_accepted = rejection_sample(target, drafts, draft_probs, [None] * N)
    return tokens, num_accepted, drafts


def check_first_two(p, tokens, num_accepted):
    # First emitted token ~ p[0].
    assert_matches(tokens[:, 0], p[0])
    # Given the first draft was accepted (the second token is only emitted then, and p[1] is the
    # target's distribution after that draft), the second emitted token ~ p[1].
    second = tokens[num_accepted >= 1, 1]
    assert second.numel() > 1000
    assert_matches(second, p[1])


@pytest.mark.parametrize("seed", [0, 1])
def test_emitted_tokens_follow_target_for_random_draft(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    p = torch.stack([random_dist(gen) for _ in range(K + 1)])
    q = torch.stack([random_dist(gen) for _ in range(K)])
    tokens, num_accepted, _ = run(p, q, seed)
    check_first_two(p, tokens, num_accepted)
    # Acceptance at position 0 is sum_x min(p, q) (Leviathan et al., section 3.3).
    expected_accept = float(torch.minimum(p[0], q[0]).sum())
    observed = float((num_accepted >= 1).double().mean())
    assert abs(observed - expected_accept) < 5 * (expected_accept * (1 - expected_accept) / N) ** 0.5 + 1e-3


def test_emitted_tokens_follow_target_for_point_mass_draft():
    gen = torch.Generator().manual_seed(7)
    p = torch.stack([random_dist(gen) for _ in range(K + 1)])
    tokens, num_accepted, _ = run(p, None, 3)
    check_first_two(p, tokens, num_accepted)
    # Point mass on d: acceptance is p(d).
    observed = float((num_accepted >= 1).double().mean())
    assert abs(observed - float(p[0, 0])) < 0.02


def test_draft_equal_to_target_is_always_accepted():
    gen = torch.Generator().manual_seed(11)
    p = torch.stack([random_dist(gen) for _ in range(K + 1)])
    tokens, num_accepted, drafts = run(p, p[:K].clone(), 4)
    assert bool((num_accepted == K).all())
    assert torch.equal(tokens[:, :K], drafts)
    assert_matches(tokens[:, K], p[K])  # the bonus token ~ p[K]


def test_target_with_zeros_never_emits_them():
    gen = torch.Generator().manual_seed(13)
    p = torch.stack([random_dist(gen, zeros=2) for _ in range(K + 1)])
    q = torch.stack([random_dist(gen, zeros=1) for _ in range(K)])
    tokens, num_accepted, _ = run(p, q, 5)
    check_first_two(p, tokens, num_accepted)
    for i in range(K + 1):
        emitted = tokens[:, i][tokens[:, i] >= 0]
        assert bool((p[i][emitted] > 0).all())


def test_draft_token_with_zero_draft_probability_accepted_iff_target_allows():
    # q(d) = 0 cannot come from a real draw; the sampler still must not emit a token p forbids.
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]] * 2)
    q = torch.tensor([[[0.0, 0.0, 1.0]], [[0.0, 0.0, 1.0]]])
    drafts = torch.tensor([[0], [2]])  # row 0: p(d) > 0 -> accepted; row 1: p(d) = 0 -> rejected
    tokens, num_accepted = rejection_sample(p, drafts, q, [None, None])
    assert num_accepted.tolist() == [1, 0]
    assert tokens[0, 0] == 0 and tokens[0, 1] >= 0
    assert tokens[1, 0] in (0, 1) and tokens[1, 1] == -1


def test_all_rejected_resamples_from_residual():
    # p puts no mass on any draft: every row rejects at position 0 and draws from p (minus d).
    p = torch.tensor([[0.0, 0.0, 0.25, 0.75]] * (K + 1)).unsqueeze(0).expand(N, -1, -1).contiguous()
    drafts = torch.zeros(N, K, dtype=torch.long)
    torch.manual_seed(6)
    tokens, num_accepted = rejection_sample(p, drafts, None, [None] * N)
    assert bool((num_accepted == 0).all())
    assert bool((tokens[:, 1:] == -1).all())
    assert_matches(tokens[:, 0], p[0, 0])


def test_rows_with_fewer_drafts_take_bonus_at_their_own_length():
    # Row 0: 1 draft, row 1: none, row 2: all K. The target is one-hot, so outcomes are exact.
    p = torch.zeros(3, K + 1, V)
    for i in range(K + 1):
        p[:, i, i] = 1.0
    drafts = torch.tensor([[0, 5, 5], [5, 5, 5], [0, 1, 2]])  # padding (5) is never read
    tokens, num_accepted = rejection_sample(p, drafts, None, [None] * 3, torch.tensor([1, 0, 3]))
    assert num_accepted.tolist() == [1, 0, 3]
    assert tokens.tolist() == [[0, 1, -1, -1], [0, -1, -1, -1], [0, 1, 2, 3]]


def test_padding_ids_outside_the_vocab_are_not_read():
    p = torch.zeros(1, K + 1, V)
    for i in range(K + 1):
        p[:, i, i] = 1.0
    drafts = torch.tensor([[0, -1, 10**6]])
    tokens, num_accepted = rejection_sample(p, drafts, torch.zeros(1, K, V), [None], torch.tensor([1]))
    # q(0) = 0 and p(0) = 1: accepted; the bonus comes from p[1].
    assert num_accepted.tolist() == [1]
    assert tokens.tolist() == [[0, 1, -1, -1]]


def test_zero_speculative_tokens_samples_the_target():
    p = torch.tensor([[[0.0, 1.0, 0.0]]])
    tokens, num_accepted = rejection_sample(p, torch.empty(1, 0, dtype=torch.long), None, [None])
    assert tokens.tolist() == [[1]] and num_accepted.tolist() == [0]


def test_seeded_rows_reproduce_and_ignore_the_batch():
    gen = torch.Generator().manual_seed(17)
    p = torch.stack([random_dist(gen) for _ in range(K + 1)])
    q = torch.stack([random_dist(gen) for _ in range(K)])
    b = 64
    target = p.unsqueeze(0).expand(b, -1, -1).contiguous()
    draft_probs = q.unsqueeze(0).expand(b, -1, -1).contiguous()
    drafts = torch.stack([torch.multinomial(q[i], b, replacement=True) for i in range(K)], dim=1)

    def seeded_run(order_seed: int):
        gens = [torch.Generator().manual_seed(1000 + r) if r % 2 == 0 else None for r in range(b)]
        torch.manual_seed(order_seed)  # the unseeded rows' global RNG differs between runs
        return rejection_sample(target, drafts, draft_probs, gens)

    t1, a1 = seeded_run(1)
    t2, a2 = seeded_run(2)
    even = torch.arange(0, b, 2)
    assert torch.equal(t1[even], t2[even]) and torch.equal(a1[even], a2[even])
    # The same seeded row alone in a batch gives the same tokens.
    alone_t, alone_a = rejection_sample(
        target[:1], drafts[:1], draft_probs[:1], [torch.Generator().manual_seed(1000)]
    )
    assert torch.equal(alone_t[0], t1[0]) and alone_a[0] == a1[0]
    # Different seeds give different streams somewhere in the batch.
    assert not torch.equal(t1[even], t1[even + 1]) or not torch.equal(t1, t2)


def test_bad_shapes_name_the_argument():
    p = torch.full((2, K + 1, V), 1.0 / V)
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(p, torch.zeros(2, K + 1, dtype=torch.long), None, [None, None])
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(p, torch.zeros(2, K, dtype=torch.long), torch.zeros(2, K, V + 1), [None, None])
    with pytest.raises(ValueError, match="generators"):
        rejection_sample(p, torch.zeros(2, K, dtype=torch.long), None, [None])
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(p, torch.full((2, K), V, dtype=torch.long), None, [None, None])
    with pytest.raises(ValueError, match="num_draft_tokens"):
        rejection_sample(p, torch.zeros(2, K, dtype=torch.long), None, [None, None], torch.tensor([0, K + 1]))


@st.composite
def batches(draw):
    b = draw(st.integers(1, 5))
    k = draw(st.integers(0, 4))
    v = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    # Distributions with random zeros (at least one positive entry per row).
    w = torch.rand(b, k + 1, v, generator=gen) * (torch.rand(b, k + 1, v, generator=gen) < 0.6)
    w[..., 0] += (w.sum(-1) == 0).float()
    p = w / w.sum(-1, keepdim=True)
    qw = torch.rand(b, k, v, generator=gen) * (torch.rand(b, k, v, generator=gen) < 0.6)
    qw[..., 0] += (qw.sum(-1) == 0).float() if k else 0.0
    q = qw / qw.sum(-1, keepdim=True) if k else qw
    drafts = torch.randint(0, v, (b, k), generator=gen)
    m = torch.randint(0, k + 1, (b,), generator=gen)
    use_q = draw(st.booleans())
    return p, drafts, q if use_q else None, m, seed


@settings(max_examples=200, deadline=None)
@given(batches())
def test_property_emitted_run_is_a_draft_prefix_plus_one_supported_token(batch):
    p, drafts, q, m, seed = batch
    b, k = drafts.shape
    gens = [torch.Generator().manual_seed(seed + r) for r in range(b)]
    tokens, num_accepted = rejection_sample(p, drafts, q, gens, m)
    assert tokens.shape == (b, k + 1) and num_accepted.shape == (b,)
    for r in range(b):
        a = int(num_accepted[r])
        assert 0 <= a <= int(m[r])
        assert tokens[r, :a].tolist() == drafts[r, :a].tolist()  # accepted drafts, in order
        for j in range(a):  # an accepted draft is never one the target forbids
            assert p[r, j, drafts[r, j]] > 0
        last = int(tokens[r, a])
        assert 0 <= last < p.shape[2] and p[r, a, last] > 0  # the sampled token is allowed
        assert bool((tokens[r, a + 1 :] == -1).all())
    # Same generators' seeds: the same result.
    again = rejection_sample(p, drafts, q, [torch.Generator().manual_seed(seed + r) for r in range(b)], m)
    assert torch.equal(again[0], tokens) and torch.equal(again[1], num_accepted)
