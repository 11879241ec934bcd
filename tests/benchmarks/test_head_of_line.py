"""The head-of-line scenario on the simulator: backfill cuts the shorts' TTFT and leaves the
long prompt's within 10%."""

import pytest

from kvserve.benchmarks.head_of_line import HeadOfLine, compare


@pytest.mark.parametrize("chunked", [False, True])
def test_backfill_helps_the_shorts_and_not_the_long_prompt_less(chunked):
    small = HeadOfLine(
        num_gpu_blocks=128,
        resident_prompt=360,
        resident_output=100,
        long_prompt=600,
        short_prompt=32,
        short_output=8,
    )
    r = compare(small, chunked=chunked)
    # without backfill the shorts wait for the long prompt, which waits for the residents
    assert r["off"]["short_ttft_p90_s"] >= 0.9 * r["off"]["long_ttft_s"]
    assert r["short_ttft_p90_speedup"] >= 3.0, r
    assert r["long_ttft_ratio"] <= 1.1, r
