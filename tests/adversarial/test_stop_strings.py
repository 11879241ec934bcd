"""Overlapping stop strings (one a prefix or an infix of another): which one fires, and where
the text is cut, must depend on the decoded text only, never on how it was split into tokens.
The rule: the stop string that is complete first while reading the text left to right (the
earliest end); among those ending at the same character, the one starting first."""

import itertools

import pytest

from kvserve.engine.stop_checker import StopChecker
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import Sequence, SequenceStatus


def _run(pieces, params):
    seq = Sequence(0, [1, 2, 3], block_size=4)
    checker = StopChecker(1000)
    for i, piece in enumerate(pieces):
        seq.append_token_id(100 + i)
        seq.output_text += piece
        checker.maybe_stop(seq, params, piece, 100)
        if seq.is_finished():
            break
    assert seq.status == SequenceStatus.FINISHED_STOPPED
    return seq.output_text, seq.stop_reason


def _splits(text):
    """Every way to cut ``text`` into 1-3 consecutive pieces."""
    n = len(text)
    yield [text]
    for i in range(1, n):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(1, n), 2):
        yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    "stops,expect_excl,expect_incl",
    [
        (["Mold", "Mo"], ("x ", "Mo"), ("x Mo", "Mo")),  # a prefix of another stop string
        (["Mo", "Mold"], ("x ", "Mo"), ("x Mo", "Mo")),
        (["x Mold", "ol"], ("x M", "ol"), ("x Mol", "ol")),  # an infix ends first
        (["old", "Mold"], ("x ", "Mold"), ("x Mold", "Mold")),  # same end: the longer (earlier start)
        (["😀", "ld😀", "d😀"], ("x Mo", "ld😀"), ("x Mold😀", "ld😀")),
    ],
)
def test_overlapping_stop_strings_do_not_depend_on_token_boundaries(stops, expect_excl, expect_incl, include):
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    expected = expect_incl if include else expect_excl
    for pieces in _splits("x Mold😀 tail"):
        assert _run(pieces, params) == expected, pieces
