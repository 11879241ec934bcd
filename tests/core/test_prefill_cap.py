"""``max_decode_slowdown``: the prompt tokens a step may carry beside running decodes, from
measured step times (``PrefillCap``), and the scheduler under it on a simulated clock."""

import pytest

from kvserve.config import EngineArgs, SchedulerConfig
from kvserve.core.prefill_cap import PrefillCap
from kvserve.sampling_params import SamplingParams
from kvserve.sim.cost_model import CostModel
from tests.core.simutil import Harness, configs, prompt_of


def test_the_cap_follows_the_measured_costs():
    cap = PrefillCap(1.5, min_tokens=16, probe_tokens=64)
    assert cap.cap() is None  # no decode step measured: nothing known to protect
    cap.observe(100, 0, 1.0)  # prompts alone: says nothing about decodes
    assert cap.cap() is None
    cap.observe(0, 4, 0.100)
    assert cap.cap() == 64  # the probe: no mixed step measured yet
    cap.observe(64, 4, 0.100 + 64 * 0.001)  # 1 ms a prompt token
    assert cap.token_s == pytest.approx(0.001)
    assert cap.cap() == 50  # (1.5 - 1) * 0.100 s / 1 ms
    cap.observe(50, 4, 0.150)
    assert cap.cap() == 50
    slow = PrefillCap(1.01, min_tokens=16)
    slow.observe(0, 4, 0.1)
    slow.observe(64, 4, 0.1 + 64 * 0.001)
    assert slow.cap() == 16  # one token of room: the floor keeps the prompt moving


def test_a_cheap_estimate_grows_the_chunk_step_by_step():
    cap = PrefillCap(2.0, probe_tokens=64)
    cap.observe(0, 4, 0.1)
    cap.observe(64, 4, 0.09)  # faster than decodes alone (noise): measured free
    assert cap.cap() == 128  # twice the last measured, not the whole budget
    cap.observe(128, 4, 0.1 + 128 * 1e-6)
    assert cap.cap() == 256


@pytest.mark.parametrize("bad", [1.0, 0.5, float("inf"), float("nan"), True, "2"])
def test_bad_slowdowns_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="max_decode_slowdown must be a finite number > 1"):
        SchedulerConfig(chunked_prefill_enabled=True, max_decode_slowdown=bad)


def test_the_slowdown_needs_chunked_prefill():
    with pytest.raises(ValueError, match="max_decode_slowdown needs chunked prefill"):
        SchedulerConfig(max_decode_slowdown=1.5)
    args = EngineArgs(max_decode_slowdown=1.5, enable_chunked_prefill=True, max_model_len=256)
    assert args.create_configs(2048)[2].max_decode_slowdown == 1.5


def _decodes_beside_a_long_prompt(slowdown):
    """Four sequences decode; a 1,500-token prompt arrives. Step costs from a cost model whose
    prompt tokens are expensive. Returns (decode-only step seconds, mixed step seconds)."""
    cc, sc = configs(BS=16, G=512, S=8, T=512, L=2048, CP=True, max_decode_slowdown=slowdown)
    h = Harness(cc, sc)
    h.executor.cost_model = CostModel(
        base_s=0.01, prefill_token_s=2e-4, decode_seq_s=1e-3, context_token_s=0.0
    )
    p = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    for i in range(4):
        h.add(f"d{i}", {"prompt_token_ids": prompt_of(i, 16)}, p)
    clock = h.executor.clock
    times = []
    for k in range(120):
        if k == 5:
            h.add("long", {"prompt_token_ids": prompt_of(9, 1500)}, SamplingParams(max_tokens=2))
        t0 = clock()
        h.step()
        out = h.history[-1]
        n_prompt = sum(s.token_chunk_size for s in out.scheduled_seq_groups[: out.num_prefill_groups])
        times.append((n_prompt, clock() - t0))
    h.run()
    h.assert_idle()
    decode = [t for n, t in times[2:] if n == 0]
    mixed = [t for n, t in times[6:] if n > 0]
    return decode, mixed


def test_decodes_beside_a_long_prompt_slow_down_at_most_the_set_factor():
    decode, mixed = _decodes_beside_a_long_prompt(1.5)
    assert mixed, "the prompt never ran"
    d = max(decode)
    # after the probe step, each mixed step stays within the factor (the model is linear)
    assert max(mixed[1:]) <= 1.5 * d * 1.02, (d, mixed)
    _, uncapped = _decodes_beside_a_long_prompt(None)
    assert max(uncapped) > 3 * d  # without the cap a 508-token chunk rides beside them


def test_a_costlier_token_is_believed_at_once_a_cheaper_one_gradually():
    cap = PrefillCap(1.5, alpha=0.25)
    cap.observe(0, 4, 0.1)
    cap.observe(100, 4, 0.1 + 100 * 0.001)
    cap.observe(100, 4, 0.1 + 100 * 0.003)  # costlier: replaces
    assert cap.token_s == pytest.approx(0.003)
    cap.observe(100, 4, 0.1 + 100 * 0.001)  # cheaper: a quarter of the way
    assert cap.token_s == pytest.approx(0.0025)
