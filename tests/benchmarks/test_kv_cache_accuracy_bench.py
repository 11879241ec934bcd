"""The KV accuracy benchmark's emulated formats and agreement counts (no model)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from kvserve.model_executor.layers import kv_quant

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_cache_accuracy.py"
_spec = importlib.util.spec_from_file_location("kv_cache_accuracy", _PATH)
acc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(acc)


@pytest.mark.parametrize("D", [32, 64, 128])
def test_whole_row_group_emulates_the_int8_cache_bit_for_bit(D):
    torch.manual_seed(0)
    x = torch.randn(50, D) * torch.logspace(-3, 2, 50).unsqueeze(1)
    x[3] = 0.0
    stored = kv_quant.dequantize(kv_quant.quantize(x, torch.int8), torch.int8, torch.float32)
    assert torch.equal(acc.emulated_rounding(f"int8-g{D}")(x), stored)


def test_group_scales_are_per_group():
    x = torch.cat((torch.full((1, 32), 1e-2), torch.full((1, 32), 100.0)), dim=1)
    x[0, 0] = 1.3e-2
    g32 = acc.emulated_rounding("int8-g32")(x)
    g64 = acc.emulated_rounding("int8-g64")(x)
    # one scale for the row flushes the small half to zero; one per 32 keeps it within a step
    assert torch.equal(g64[0, :32], torch.zeros(32))
    assert (g32[0, :32] - x[0, :32]).abs().max() <= 1.3e-2 / 254 * 1.001
    with pytest.raises(ValueError, match="does not divide head_dim 64"):
        acc.emulated_rounding("int8-g48")(torch.zeros(2, 64))
    assert acc.emulated_rounding("int8") is None


def test_bf16_emulation_rounds_to_bfloat16():
    x = torch.tensor([[1.0 + 2.0**-9, 3.0]])
    assert acc.emulated_rounding("bf16")(x).tolist() == [[1.0, 3.0]]


def test_compare_counts_agreement_prefixes_and_near_ties():
    ref = {"tokens": [[1, 2, 3], [1, 2, 3], [4, 5, 6]], "nll": 2.0}
    ref["top2"] = [[[-0.1, -3.0]] * 3, [[-0.1, -3.0], [-0.70, -0.72], [-0.1, -2.0]], [[-0.5, -1.5]] * 3]
    run = {"tokens": [[1, 2, 3], [1, 9, 9], [7, 5, 6]], "nll": 2.02}
    row = acc.compare(run, ref, 3, tie_nats=0.05)
    assert row["agree"] == 1 and row["agree_with_ties"] == 2
    assert row["mean_agreeing_prefix"] == pytest.approx((3 + 1 + 0) / 3)
    assert [(d["prompt"], d["position"]) for d in row["diverged"]] == [(1, 1), (2, 0)]
    assert row["diverged"][0]["ref_gap"] == pytest.approx(0.02)
    assert row["nll_change"] == pytest.approx(0.01)
    assert acc.compare(run, ref, 3, tie_nats=0.0)["agree_with_ties"] == 1
