"""``max_decode_slowdown``: the prompt tokens a step may carry beside running decodes, from
measured step times (``PrefillCap``), and the scheduler under it on a simulated clock."""

import pytest

from kvserve.config import EngineArgs, SchedulerConfig
from kvserve.core.prefill_cap import PrefillCap
from kvserve.sampling_params import SamplingParams
from kvserve.sim.cost_model import CostModel
from tests.core.simutil import Harness, configs, prompt_of


def test_the_bucket_earns_per_decode_step_and_pays_for_prompt_tokens():
    cap = PrefillCap(1.5, min_tokens=16, probe_tokens=64)
    assert cap.cap() is None  # no decode step measured: nothing known to protect
    cap.observe(100, 0, 1.0)  # prompts alone: says nothing about decodes
    assert cap.cap() is None
    cap.observe(0, 4, 0.100)
    assert cap.bucket == pytest.approx(0.050)  # (1.5 - 1) x 0.1 s
    assert cap.cap() == 64  # the probe: no mixed step measured yet
    cap.observe(64, 4, 0.100 + 0.064)  # 1 ms a prompt token
    assert cap.token_s == pytest.approx(0.001)
    assert cap.bucket == pytest.approx(0.050 + 0.050 - 0.064)
    assert cap.cap() == 36  # what the bucket holds, over a token's time
    cap.observe(36, 4, 0.100 + 0.036 + 0.100)  # a mixed step that cost far more than its tokens
    assert cap.bucket < 0 and cap.cap() == 0  # decodes alone until the bucket refills
    for _ in range(3):
        cap.observe(0, 4, 0.100)
    assert cap.cap() > 0
    for _ in range(100):
        cap.observe(0, 4, 0.100)
    assert cap.bucket == pytest.approx(8 * 0.050)  # it holds BUCKET_STEPS steps' earnings


def test_over_a_run_the_decodes_mean_step_stays_within_the_factor():
    """A mixed step costs a fixed 50 ms beyond the decodes plus 1 ms a token (a decode step is
    100 ms): no chunk alone fits in 1.5x, but interleaved with decode-only steps the mean does."""
    cap = PrefillCap(1.5)
    cap.observe(0, 8, 0.100)
    steps = []
    for _ in range(400):
        n = cap.cap()
        t = 0.100 + (0.050 + 0.001 * n if n else 0.0)
        cap.observe(n, 8, t)
        steps.append((n, t))
    assert sum(n for n, _ in steps) > 2000  # the prompt still moves
    assert sum(t for _, t in steps) / len(steps) <= 1.5 * 0.100 * 1.01


def test_a_cheap_estimate_grows_the_chunk_step_by_step():
    cap = PrefillCap(2.0, probe_tokens=64)
    for _ in range(8):
        cap.observe(0, 4, 0.1)
    cap.observe(64, 4, 0.09)  # faster than decodes alone (noise): measured free
    assert cap.cap() == 128  # twice the last measured, not the whole bucket
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
    prompt tokens are expensive. Returns (step seconds before it arrives, step seconds from its
    first chunk to its last)."""
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
    decode = [t for n, t in times[2:5]]  # before the prompt arrives
    prompt_steps = [k for k, (n, _) in enumerate(times) if n > 0]
    during = [t for _, t in times[prompt_steps[0] : prompt_steps[-1] + 1]] if prompt_steps else []
    return decode, during


def test_decodes_beside_a_long_prompt_slow_down_at_most_the_set_factor():
    """Over the steps from the prompt's first chunk to its last, the decodes' mean step is
    within the factor of a decode step (plus what the bucket held when the prompt came)."""
    decode, during = _decodes_beside_a_long_prompt(1.5)
    assert during, "the prompt never ran"
    d = max(decode)
    assert sum(during) / len(during) <= 1.5 * d * 1.05, (d, during)
    _, uncapped = _decodes_beside_a_long_prompt(None)
    assert sum(uncapped) / len(uncapped) > 3 * d  # without the cap 508-token chunks ride beside them


def test_a_costlier_token_is_believed_at_once_a_cheaper_one_gradually():
    cap = PrefillCap(1.5, alpha=0.25)
    cap.observe(0, 4, 0.1)
    cap.observe(100, 4, 0.1 + 100 * 0.001)
    cap.observe(100, 4, 0.1 + 100 * 0.003)  # costlier: replaces
    assert cap.token_s == pytest.approx(0.003)
    cap.observe(100, 4, 0.1 + 100 * 0.001)  # cheaper: a quarter of the way
    assert cap.token_s == pytest.approx(0.0025)


def test_a_stall_does_not_lift_the_reference_and_huge_factors_do_not_overflow():
    cap = PrefillCap(1.5)
    cap.observe(0, 8, 0.030)
    cap.observe(0, 8, 5.0)  # a stall of another process's making
    assert cap.decode_s == pytest.approx(0.030 + 0.25 * (0.060 - 0.030))
    huge = PrefillCap(1.7e308)
    huge.observe(0, 8, 0.03)
    huge.observe(64, 8, 0.03 + 1e-12)
    assert huge.cap() == 128  # the growth bound, not an overflow
