"""Beam search scoring at the ends of ``length_penalty``'s allowed range (+-float32 max):
``length ** length_penalty`` over- and underflows there, which raised ``OverflowError`` /
``ZeroDivisionError`` after the whole search (HTTP 500). The scores now saturate and the
hypotheses still rank as their true scores ``cum / length ** length_penalty`` do."""

import math

import pytest

from kvserve.entrypoints.beam_search import BeamSearch, length_penalized
from kvserve.field_limits import FLOAT32_MAX
from kvserve.sampling_params import BeamSearchParams
from kvserve.sequence import Logprob

EOS = 0
#: every beam's next-token logprobs: EOS ranks second, so a hypothesis ends at every length
STEP = {1: -0.1, EOS: -0.15, 2: -0.2, 3: -5.0}


def _search(length_penalty: float) -> list[tuple[list[int], float]]:
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=length_penalty)
    search = BeamSearch([7, 8], params, EOS, max_tokens=3)
    while search.pending():
        search.advance([{t: Logprob(v) for t, v in STEP.items()} for _ in search.pending()])
    return [(s.output_token_ids, s.score) for s in search.output().sequences]


def test_length_penalty_one_is_the_mean_logprob():
    # step 1 ends [EOS] (-0.15 / 1); step 2 ends [1, EOS] (-0.25 / 2); step 3 reaches max_tokens:
    # [1, 1, 1] (-0.3 / 3) and [1, 1, EOS] (-0.35 / 3) beat both
    out = _search(1.0)
    assert [t for t, _ in out] == [[1, 1, 1], [1, 1, EOS]]
    assert [s for _, s in out] == pytest.approx([-0.3 / 3, -0.35 / 3])


def test_largest_length_penalty_prefers_the_longest_hypotheses():
    out = _search(FLOAT32_MAX)
    # true scores -0.3 / 3**L and -0.35 / 3**L (L = float32 max) beat every shorter one
    assert [t for t, _ in out] == [[1, 1, 1], [1, 1, EOS]]
    for _, score in out:
        assert score == 0.0 and math.copysign(1.0, score) == -1.0  # -0.0: underflowed


def test_most_negative_length_penalty_prefers_the_shortest_hypotheses():
    out = _search(-FLOAT32_MAX)
    assert [t for t, _ in out] == [[EOS], [1, EOS]]
    assert out[0][1] == pytest.approx(-0.15)  # length 1: 1 ** anything = 1
    assert out[1][1] == -math.inf  # -0.25 * 2 ** (float32 max): overflowed


@pytest.mark.parametrize("lp", [FLOAT32_MAX, -FLOAT32_MAX, 1e300, -1e300, 5e-324, 0.0])
def test_length_penalized_never_raises_and_orders_as_the_true_score(lp):
    # (cum, length) pairs in the order of their true scores cum / length ** lp, best first,
    # derived from log |score| = ln(-cum) - lp * ln(length)
    pairs = [(0.0, 5), (-1e-300, 1), (-0.5, 1), (-2.0, 1), (-0.5, 3), (-2.0, 3), (-math.inf, 2)]
    true_log = [
        -math.inf if c == 0 else (math.inf if c == -math.inf else math.log(-c) - lp * math.log(n))
        for c, n in pairs
    ]
    expected = sorted(range(len(pairs)), key=lambda i: true_log[i])
    keys = [length_penalized(c, n, lp) for c, n in pairs]
    got = sorted(range(len(pairs)), key=lambda i: keys[i], reverse=True)
    assert got == expected
    for (c, n), (score, _) in zip(pairs, keys):
        assert score <= 0.0 and not math.isnan(score)
        if c != 0 and math.isfinite(c) and lp in (0.0, 5e-324):
            assert score == c / n**lp  # transformers' value wherever it is finite
