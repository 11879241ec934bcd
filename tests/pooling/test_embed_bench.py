"""``kvserve bench embed``'s workload: seeded sentences of 10-60 words."""

from kvserve.benchmarks.embed import make_texts


def test_texts_are_seeded_and_within_the_word_range():
    texts = make_texts(256, seed=3)
    assert texts == make_texts(256, seed=3) and texts != make_texts(256, seed=4)
    counts = [len(t.split()) for t in texts]
    assert len(texts) == 256 and min(counts) >= 10 and max(counts) <= 60
    assert max(counts) - min(counts) > 30  # lengths vary (the scheduler's packing is exercised)
