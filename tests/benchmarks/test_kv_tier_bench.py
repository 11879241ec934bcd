"""The host-tier benchmark on a few trace rows: with a tier the prefix hit rate is higher than
without, and the host hits are what make the difference."""

import argparse
from pathlib import Path

import pytest

from kvserve.benchmarks import kv_tier
from kvserve.envs import shared_dir

TRACE = shared_dir() / kv_tier.DEFAULT_TRACE


@pytest.mark.skipif(not Path(TRACE).is_file(), reason="the shared Mooncake trace is not here")
def test_host_tier_raises_the_prefix_hit_rate():
    ns = argparse.Namespace(
        trace=str(TRACE),
        num_requests=120,
        block_tokens=16,
        max_blocks=32,
        max_output_len=8,
        time_scale=0.25,
        num_gpu_blocks=256,
        tiers=[0, 2048],
    )
    base, tier = kv_tier.run(ns)
    assert base["host hit blocks"] == 0 and tier["host hit blocks"] > 0
    assert tier["prefix hit rate"] > base["prefix hit rate"]
    assert base["finished"] == tier["finished"] == 120
