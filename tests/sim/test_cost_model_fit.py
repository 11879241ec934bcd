"""The richer cost model: step shapes, the fit, and the simulated executor's use of both."""

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvserve.sampling_params import SamplingParams
from kvserve.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata
from kvserve.sim.cost_model import (
    FEATURES,
    CostModel,
    context_feature,
    decode_knot_candidates,
    fit_cost_model,
    fit_errors,
    prefill_knot_candidates,
    prompt_rows,
)
from kvserve.sim.executor import InvalidExecuteRequest, SimulatedExecutor
from kvserve.sim.step_shape import StepShape, step_shape


def _meta(rid, data, table, chunk, is_prompt=True, sid=0):
    return SequenceGroupMetadata(
        request_id=rid,
        is_prompt=is_prompt,
        seq_data={sid: data},
        sampling_params=SamplingParams(),
        block_tables={sid: table},
        token_chunk_size=chunk,
        do_sample=not is_prompt or data.get_num_computed_tokens() + chunk == data.get_len(),
    )


def test_step_shape_counts_chunks_decodes_pairs_and_moves():
    first = SequenceData(list(range(10)))  # a chunk of 4 after 6 computed: not the last
    first.update_num_computed_tokens(4)
    whole = SequenceData(list(range(3)))
    dec = SequenceData(list(range(7)))
    dec.update_num_computed_tokens(6)
    req = ExecuteModelRequest(
        [
            _meta("a", first, [0, 1, 2], 4),
            _meta("b", whole, [3], 3),
            _meta("c", dec, [4, 5], 1, is_prompt=False),
        ],
        blocks_to_swap_out={7: 1},
        blocks_to_swap_in={2: 8},
        blocks_to_copy={5: [9, 10]},
    )
    s = step_shape(req)
    assert (s.prefill_tokens, s.prefill_seqs, s.decode_seqs, s.context_tokens) == (7, 2, 1, 7)
    # chunk of 4 after 4: 4*4 + 4*5/2 = 26 pairs; whole prompt of 3: 6 pairs
    assert s.prefill_attn_pairs == pytest.approx((26 + 6) / 1000)
    assert s.sampled_rows == 2  # "a" ends mid-prompt: no sample
    assert (s.swapped_blocks, s.copied_blocks) == (2, 2)
    assert s.shape_class == "swap"


def test_shape_classes():
    assert StepShape(prefill_tokens=5, prefill_seqs=1).shape_class == "prefill"
    assert StepShape(decode_seqs=2, context_tokens=9).shape_class == "decode"
    assert StepShape(prefill_tokens=5, decode_seqs=2).shape_class == "mixed"
    assert StepShape().shape_class == "empty" and CostModel().step_cost(StepShape()) == 0.0


def _grid_shapes():
    shapes = []
    for p in (0, 16, 128, 512):
        for b in (0, 1, 8, 32):
            for ctx in (32, 512):
                if p == 0 and b == 0:
                    continue
                k = 1 if p else 0
                shapes.append(
                    StepShape(
                        prefill_tokens=p,
                        prefill_seqs=k,
                        prefill_attn_pairs=p * (p + 1) / 2000,
                        decode_seqs=b,
                        context_tokens=b * ctx,
                        sampled_rows=b + k,
                        # adapters in some steps, independent of the other counts
                        loras=min(b, 2) if ctx == 512 else 0,
                    )
                )
    return shapes


def test_fit_recovers_the_coefficients_of_noiseless_steps():
    truth = CostModel(
        base_s=0.01,
        prefill_token_s=2e-4,
        prefill_seq_s=0.0,
        prefill_attn_s=3e-4,
        decode_seq_s=1e-3,
        context_token_s=2e-6,
        sample_s=0.0,
        swap_block_s=0.0,
    )
    samples = [(s, truth.step_cost(s)) for s in _grid_shapes()]
    fit = fit_cost_model(samples)
    for k, v in truth.coefficients().items():
        assert getattr(fit, k) == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert fit_errors(fit, samples)["all"]["max"] < 1e-6


@settings(max_examples=30, deadline=None)
@given(
    base=st.floats(1e-4, 0.1),
    tok=st.floats(1e-6, 1e-3),
    attn=st.floats(0.0, 1e-3),
    seq=st.floats(1e-5, 1e-2),
    ctx=st.floats(0.0, 1e-5),
)
def test_fit_reproduces_any_nonnegative_linear_cost(base, tok, attn, seq, ctx):
    """Property: for any coefficients >= 0, the fit of exact step times predicts them (the
    features may trade off where they are collinear; the predictions may not)."""
    truth = CostModel(
        base_s=base,
        prefill_token_s=tok,
        prefill_attn_s=attn,
        decode_seq_s=seq,
        context_token_s=ctx,
        swap_block_s=0.0,
    )
    samples = [(s, truth.step_cost(s)) for s in _grid_shapes()]
    fit = fit_cost_model(samples)
    assert all(v >= 0 for v in fit.coefficients().values())
    assert fit_errors(fit, samples)["all"]["max"] < 1e-3


def _decode_grid(batches=(1, 2, 4, 8, 16, 32, 64), contexts=(32, 288, 1024), steps=3):
    """Decode-only steps (repeated ``steps`` times, as a profile's decode runs) and a few prefills."""
    shapes = [StepShape(prefill_tokens=p, prefill_seqs=1, sampled_rows=1) for p in (16, 64, 256, 1024)]
    for b in batches:
        for L in contexts:
            shapes += [StepShape(decode_seqs=b, context_tokens=b * L, sampled_rows=b)] * steps
    return shapes


def test_decode_knots_recover_a_convex_batch_curve():
    """Time per decode flat to 8 decodes, then 3x steeper (the weight-streaming GEMM filling its
    row blocks): a line through the batches misses the middle; knots at the measured batches
    fit it exactly, and leave mixed steps on the line."""
    truth = CostModel(
        base_s=0.02,
        prefill_token_s=1e-4,
        decode_seq_s=2e-4,
        context_token_s=1e-7,
        swap_block_s=0.0,
        lora_adapter_s=0.0,
        decode_knots={8: 4e-4},
    )
    shapes = _decode_grid()
    samples = [(s, truth.step_cost(s)) for s in shapes]
    assert decode_knot_candidates(samples) == [2, 4, 8, 16, 32]
    line = fit_cost_model(samples)
    mid = [(s, t) for s, t in samples if s.decode_seqs in (8, 16)]
    assert fit_errors(line, mid)["all"]["total"] > 0.03  # the line over-predicts the bend
    knotted = fit_cost_model(samples, decode_knots=decode_knot_candidates(samples))
    assert fit_errors(knotted, samples)["all"]["max"] < 1e-6
    assert knotted.decode_knots == pytest.approx({8: 4e-4}, rel=1e-4)
    # a mixed step's decodes pay no knot: its GEMM rows are mostly prompt tokens
    mixed = StepShape(
        prefill_tokens=100, prefill_seqs=1, decode_seqs=32, context_tokens=3200, sampled_rows=33
    )
    assert knotted.step_cost(mixed) == pytest.approx(
        CostModel(**{**knotted.coefficients(), "decode_knots": {}}).step_cost(mixed)
    )


def _prompt_grid():
    """Prompt-bearing steps: single chunks of 16..2048 tokens, batched chunks, mixed steps."""
    shapes = []
    for n in (16, 64, 256, 1024, 2048):
        for seqs in (1, 2, 4):
            per = n // seqs
            shapes.append(
                StepShape(
                    prefill_tokens=n,
                    prefill_seqs=seqs,
                    prefill_attn_pairs=seqs * per * (per + 1) / 2000,
                    sampled_rows=seqs,
                )
            )
    for n in (16, 128, 512, 2000):
        for b in (2, 16, 64):
            shapes.append(
                StepShape(
                    prefill_tokens=n,
                    prefill_seqs=1,
                    prefill_attn_pairs=n * (n + 1) / 2000,
                    decode_seqs=b,
                    context_tokens=192 * b,
                    sampled_rows=b + 1,
                )
            )
    return shapes + _decode_grid()


def test_prefill_knots_recover_a_concave_token_curve():
    """Time per prompt token 3x higher below 512 rows than past them (bfloat16 GEMMs filling
    their tiles better as the step grows): one line misses the 100-1,000-token steps; knots at
    the powers of two fit it exactly, and leave decode-only steps alone."""
    truth = CostModel(
        base_s=0.01,
        prefill_token_s=1e-4,
        prefill_seq_s=2e-3,
        prefill_attn_s=7e-5,
        decode_seq_s=2e-4,
        context_token_s=1e-7,
        swap_block_s=0.0,
        lora_adapter_s=0.0,
        prefill_knots={512: 2e-4},
    )
    samples = [(s, truth.step_cost(s)) for s in _prompt_grid()]
    # 16 rows the fewest, 2,064 the most (2,000 prompt tokens + 64 decodes)
    assert prefill_knot_candidates(samples) == [32, 64, 128, 256, 512, 1024, 2048]
    line = fit_cost_model(samples)
    mid = [(s, t) for s, t in samples if 100 <= prompt_rows(s) <= 600]
    assert fit_errors(line, mid)["all"]["total"] < -0.05  # the line under-predicts them
    knotted = fit_cost_model(samples, prefill_knots=prefill_knot_candidates(samples))
    assert fit_errors(knotted, samples)["all"]["max"] < 1e-6
    assert knotted.prefill_knots == pytest.approx({512: 2e-4}, rel=1e-4)
    # rows are the forward's: a mixed step's decodes count, a decode-only step pays no knot
    mixed = StepShape(prefill_tokens=100, prefill_seqs=1, decode_seqs=32, context_tokens=3200)
    assert prompt_rows(mixed) == 132
    plain = CostModel(**{**knotted.coefficients(), "prefill_knots": {}})
    assert knotted.step_cost(mixed) - plain.step_cost(mixed) == pytest.approx(132 * 2e-4, rel=1e-4)
    dec = StepShape(decode_seqs=32, context_tokens=3200, sampled_rows=32)
    assert knotted.step_cost(dec) == pytest.approx(plain.step_cost(dec))
    decodes = [(s, 0.1) for s in _decode_grid() if not s.prefill_tokens]
    assert prefill_knot_candidates(decodes) == []
    with pytest.raises(ValueError, match="prefill_knots"):
        fit_cost_model(samples, prefill_knots=[0])


def test_knot_candidates_skip_the_ends_and_rare_batches():
    rare = [(StepShape(decode_seqs=3, context_tokens=30), 0.1)] * 2  # seen twice: not a candidate
    samples = [(s, 0.1) for s in _decode_grid(batches=(1, 4, 16, 64))] + rare
    assert decode_knot_candidates(samples) == [4, 16]
    with pytest.raises(ValueError, match="decode_knots"):
        fit_cost_model(samples, decode_knots=[0])


def test_attention_split_charges_the_idle_last_round():
    # 3 KV heads over 2 threads: one decode runs 2 rounds for 3 items (4/3 per token), two run 3 for 6
    one = StepShape(decode_seqs=1, context_tokens=900)
    two = StepShape(decode_seqs=2, context_tokens=1800)
    assert context_feature(one, (3, 2)) == pytest.approx(1200)
    assert context_feature(two, (3, 2)) == pytest.approx(1800)
    assert context_feature(StepShape(decode_seqs=3, context_tokens=900), (3, 2)) == pytest.approx(1000)
    assert context_feature(one, None) == 900 and context_feature(one, (3, 1)) == 900
    assert context_feature(StepShape(prefill_tokens=5, prefill_seqs=1), (3, 2)) == 0


def test_fit_with_the_attention_split_recovers_one_per_token_cost():
    truth = CostModel(
        base_s=0.02,
        prefill_token_s=1e-4,
        decode_seq_s=2e-4,
        context_token_s=2e-6,
        swap_block_s=0.0,
        lora_adapter_s=0.0,
        attention_split=(3, 2),
    )
    samples = [(s, truth.step_cost(s)) for s in _decode_grid(batches=(1, 3, 5, 16))]
    plain = fit_cost_model(samples)
    assert fit_errors(plain, samples)["all"]["max"] > 0.01  # no line fits the odd batches
    split = fit_cost_model(samples, attention_split=(3, 2))
    assert split.context_token_s == pytest.approx(2e-6, rel=1e-6)
    assert split.attention_split == (3, 2)
    assert fit_errors(split, samples)["all"]["max"] < 1e-6


def test_fit_keeps_gross_stalls_out_of_the_line_but_in_the_sum():
    """Steps stalled 20x by the host (past the 10x trim) do not bend the coefficients' ratios
    (the line is fitted on the others), but their time is spread over all steps: the summed
    prediction is the summed measurement."""
    truth = CostModel(base_s=0.01, prefill_token_s=1e-4, decode_seq_s=1e-3, context_token_s=0.0)
    samples = [(s, truth.step_cost(s)) for s in _grid_shapes()]
    samples = [(s, t * (20.0 if i % 9 == 0 else 1.0)) for i, (s, t) in enumerate(samples)]
    fit = fit_cost_model(samples)
    scale = fit.base_s / 0.01
    assert scale > 1.5  # the stalls' time is in
    assert fit.prefill_token_s == pytest.approx(1e-4 * scale, rel=0.02)
    assert fit.decode_seq_s == pytest.approx(1e-3 * scale, rel=0.02)
    assert fit_errors(fit, samples)["all"]["total"] == pytest.approx(0.0, abs=1e-9)
    plain = fit_cost_model([(s, truth.step_cost(s)) for s in _grid_shapes()])
    assert plain.base_s == pytest.approx(0.01, rel=1e-6)  # nothing trimmed: no factor


def test_fit_keeps_moderately_slow_steps_in_the_mean():
    """Steps 4x slower than the rest (within the trim) are part of what a replay's clock sums:
    the fit predicts their shape's mean, not the fast majority."""
    truth = CostModel(base_s=0.01, prefill_token_s=1e-4, decode_seq_s=1e-3, context_token_s=0.0)
    samples = []
    for s in _grid_shapes():
        t = truth.step_cost(s)
        samples += [(s, t), (s, t), (s, t), (s, 4 * t)]  # mean 1.75 t
    fit = fit_cost_model(samples)
    for s in _grid_shapes():
        assert fit.step_cost(s) == pytest.approx(1.75 * truth.step_cost(s), rel=0.01)
    with pytest.raises(ValueError, match="trim must be > 1"):
        fit_cost_model(samples, trim=1.0)


def test_fit_never_gives_negative_coefficients():
    # times that fall with context would want a negative context_token_s
    samples = [
        (StepShape(decode_seqs=1, context_tokens=c, sampled_rows=1), 0.02 - c * 1e-6)
        for c in range(10, 200, 10)
    ]
    fit = fit_cost_model(samples)
    assert all(v >= 0 for v in fit.coefficients().values()) and fit.context_token_s == 0.0


def test_fit_needs_enough_positive_samples():
    with pytest.raises(ValueError, match="at least"):
        fit_cost_model([(StepShape(decode_seqs=1), 0.1)])
    with pytest.raises(ValueError, match="> 0"):
        fit_cost_model([(StepShape(decode_seqs=i + 1), 0.0) for i in range(20)])


def test_simulated_executor_charges_the_quadratic_prefill_term():
    cm = CostModel(base_s=0.0, prefill_token_s=0.0, decode_seq_s=0.0, context_token_s=0.0, prefill_attn_s=1.0)
    times = []
    for n in (8, 16):
        ex = SimulatedExecutor(100, cm, block_size=4, num_gpu_blocks=8)
        ex.execute_model(ExecuteModelRequest([_meta("a", SequenceData(list(range(n))), [0, 1, 2, 3], n)]))
        times.append(ex.clock.now())
    assert times == [pytest.approx(8 * 9 / 2000), pytest.approx(16 * 17 / 2000)]
    assert times[1] / times[0] > 3.5  # ~quadratic, not linear


def test_builtin_cost_model_says_it_is_not_this_machine():
    d = CostModel().describe()
    assert "Llama-2-70B" in d and "H100" in d and "not this machine" in d
    assert set(CostModel().coefficients()) == {"base_s", *FEATURES}
    assert not math.isnan(CostModel().step_time(10, 1, 10))


def test_block_table_entry_out_of_range_is_named():
    ex = SimulatedExecutor(100, block_size=4, num_gpu_blocks=8)
    with pytest.raises(InvalidExecuteRequest, match="block table block 8 out of range"):
        ex.execute_model(ExecuteModelRequest([_meta("a", SequenceData([1, 2, 3, 4, 5]), [0, 8], 5)]))
    with pytest.raises(InvalidExecuteRequest, match="block table block -1 out of range"):
        ex.execute_model(ExecuteModelRequest([_meta("a", SequenceData([1, 2, 3]), [-1], 3)]))


# derandomize: the 4% bound is empirical (the worst of 300 random draws was 3.2%), not true of
# every draw by construction -- the noise is random, so a rare draw of many spikes on one shape
# class can take the fitted sum past any fixed bound; the float rounding of the sums themselves
# (~1e-13 relative for a few hundred positive terms) is nowhere near it. With fresh random
# examples each run, CI failed now and then on such a draw; it runs a fixed set of examples
# (hypothesis' derandomized search, the same every run) plus the pinned one below.
@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    sigma=st.floats(0.05, 0.4),
    spike_rate=st.floats(0.0, 0.05),
    spike=st.floats(1.5, 4.0),
    base=st.floats(1e-3, 0.05),
    tok=st.floats(1e-5, 1e-3),
    seq=st.floats(1e-5, 2e-3),
)
# Found by hypothesis: 4x spikes in 3% of the steps, sigma 0.25: 3.2% short
@example(seed=1339317, sigma=0.25, spike_rate=0.03125, spike=4.0, base=0.0078125, tok=1e-05, seq=0.001953125)
def test_fit_predicts_the_summed_time_of_noisy_steps(seed, sigma, spike_rate, spike, base, tok, seq):
    """Property: on steps with multiplicative log-normal noise (sigma up to 0.4: a host whose
    speed drifts) and rare slow spikes (up to 4x, within the trim), the fitted model's summed
    prediction is within 4% of the samples' sum -- what a replay's clock accumulates. (The
    earlier fit, trimming at 3x the median deviation and favouring fast repeats, came out
    up to 12% short on such samples; trimming at 5x, up to 10%. This one: at most 3.2% over
    300 random draws and the pinned example; 3% was the bound until hypothesis found that
    example: the relative weights fit each shape's mean, not the sum over shapes exactly.)"""
    import numpy as np

    rng = np.random.default_rng(seed)
    truth = CostModel(base_s=base, prefill_token_s=tok, decode_seq_s=seq, context_token_s=1e-6, info={})
    samples = []
    for s in _grid_shapes():
        for _ in range(8):
            t = truth.step_cost(s) * float(rng.lognormal(0.0, sigma))
            if rng.random() < spike_rate:
                t *= spike
            samples.append((s, t))
    fit = fit_cost_model(samples)
    total = sum(t for _, t in samples)
    predicted = sum(fit.step_cost(s) for s, _ in samples)
    assert abs(predicted - total) / total < 0.04
    assert abs(fit_errors(fit, samples)["all"]["total"]) < 0.04
