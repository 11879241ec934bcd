"""Stop conditions on decoded text, ids and lengths (B19 at the unit level)."""

from kvserve.engine.stop_checker import StopChecker
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import Sequence, SequenceStatus


def _seq_with_text(pieces, params, max_tokens=100, max_model_len=1000, eos=None):
    seq = Sequence(0, [1, 2, 3], block_size=4, eos_token_id=eos)
    checker = StopChecker(max_model_len)
    for i, piece in enumerate(pieces):
        seq.append_token_id(100 + i)
        seq.output_text += piece
        checker.maybe_stop(seq, params, piece, max_tokens)
        if seq.is_finished():
            break
    return seq


def test_stop_string_inside_a_token():
    seq = _seq_with_text([" The", " capital", " is", " Paris", "."], SamplingParams(stop=["Pari"]))
    assert seq.status == SequenceStatus.FINISHED_STOPPED
    assert seq.output_text == " The capital is "
    assert seq.stop_reason == "Pari"
    assert seq.get_output_len() == 4


def test_stop_string_spanning_tokens_and_included():
    params = SamplingParams(stop=["al is"], include_stop_str_in_output=True)
    seq = _seq_with_text([" The", " capit", "al", " is", " Paris"], params)
    assert seq.status == SequenceStatus.FINISHED_STOPPED
    assert seq.output_text == " The capital is"


def test_earliest_of_several_stop_strings_wins():
    seq = _seq_with_text(["abc def ghi"], SamplingParams(stop=["ghi", "def"]))
    assert seq.output_text == "abc " and seq.stop_reason == "def"


def test_stop_token_id_and_min_tokens():
    params = SamplingParams(stop_token_ids=[101], min_tokens=0)
    seq = _seq_with_text(["a", "b", "c"], params)
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.stop_reason == 101
    assert seq.output_text == "a"  # the stop token's text is not included
    params = SamplingParams(stop_token_ids=[101], min_tokens=3)
    seq = _seq_with_text(["a", "b", "c", "d"], params, max_tokens=4)
    assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED and seq.get_output_len() == 4


def test_length_caps():
    seq = _seq_with_text(["x"] * 10, SamplingParams(), max_tokens=3)
    assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED and seq.get_output_len() == 3
    seq = _seq_with_text(["x"] * 10, SamplingParams(), max_tokens=100, max_model_len=5)
    assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED and seq.get_len() == 5


def test_eos_unless_ignored():
    seq = Sequence(0, [1], block_size=4, eos_token_id=7)
    seq.append_token_id(7)
    StopChecker(100).maybe_stop(seq, SamplingParams(), "", 10)
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.stop_reason is None
    seq = Sequence(1, [1], block_size=4, eos_token_id=7)
    seq.append_token_id(7)
    StopChecker(100).maybe_stop(seq, SamplingParams(ignore_eos=True), "", 10)
    assert not seq.is_finished()
