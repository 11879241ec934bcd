"""``kvserve bench embed``'s workload: seeded sentences of 10-60 words."""

from kvserve.benchmarks.embed_inputs import make_texts


def test_texts_are_seeded_and_within_the_word_range():
    texts = make_texts(256, seed=3)
    assert texts == make_texts(256, seed=3) and texts != make_texts(256, seed=4)
    counts = [len(t.split()) for t in texts]
    assert len(texts) == 256 and min(counts) >= 10 and max(counts) <= 60
    assert max(counts) - min(counts) > 30  # lengths vary (the scheduler's packing is exercised)


def test_summary_counts_failures_and_takes_percentiles_of_the_successes():
    from kvserve.benchmarks.embed_online import summarize

    lat = [10.0, None, 30.0, 20.0, 40.0]
    s = summarize(lat, [5, 0, 7, 6, 2], 2.0)
    assert (s["num_requests"], s["num_ok"], s["num_failed"]) == (5, 4, 1)
    assert s["sentences_per_s"] == 2.0 and s["prompt_tokens_per_s"] == 10.0
    assert s["latency_max_ms"] == 40.0
    assert 10.0 <= s["latency_p50_ms"] <= s["latency_p90_ms"] <= s["latency_p99_ms"] <= 40.0
