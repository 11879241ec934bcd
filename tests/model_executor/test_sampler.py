"""Tests of kvserve.model_executor.sampler (CPU, fast)."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.model_executor.sampler import Sampler, apply_penalties, apply_top_k_top_p_min_p
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import SequenceData, SequenceGroupMetadata

EOS = 3


def md(
    params: SamplingParams,
    seqs: dict[int, SequenceData] = None,
    *,
    num_samples: int = 1,
    seed_gen: int | None = None,
    do_sample: bool = True,
    request_id: str = "r",
) -> SequenceGroupMetadata:
    seqs = seqs if seqs is not None else {0: SequenceData([1, 2])}
    gen = None
    if seed_gen is not None:
        gen = torch.Generator().manual_seed(seed_gen)
    return SequenceGroupMetadata(
        request_id=request_id,
        is_prompt=True,
        seq_data=seqs,
        sampling_params=params,
        block_tables={},
        token_chunk_size=1,
        do_sample=do_sample,
        num_samples=num_samples,
        generator=gen,
    )


def tokens(outs) -> list[list[int]]:
    return [[s.output_token for s in o.samples] for o in outs]


def test_greedy_is_argmax_and_fast_path():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    metas = [md(SamplingParams(temperature=0.0), {i: SequenceData([1])}) for i in range(5)]
    outs = Sampler(EOS)(logits, metas)
    assert tokens(outs) == [[t] for t in logits.argmax(-1).tolist()]
    lsm = logits.log_softmax(-1)
    for i, o in enumerate(outs):
        s = o.samples[0]
        assert s.parent_seq_id == i and s.top_logprobs is None
        assert s.logprob == pytest.approx(lsm[i, s.output_token].item(), abs=1e-5)


def test_greedy_general_path_matches_argmax_on_raw_logits():
    # A random row with logprobs forces the general path; greedy rows must be untouched.
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    metas = [
        md(SamplingParams(temperature=0.0), {0: SequenceData([1])}),
        md(SamplingParams(temperature=1.0, logprobs=2), {1: SequenceData([1])}),
        md(SamplingParams(temperature=0.0, logprobs=0), {2: SequenceData([1])}),
    ]
    outs = Sampler(EOS)(logits, metas)
    assert outs[0].samples[0].output_token == logits[0].argmax().item()
    assert outs[2].samples[0].output_token == logits[2].argmax().item()


def test_top_k_1_and_tiny_top_p_equal_greedy():
    torch.manual_seed(2)
    logits = torch.randn(6, 100) * 3
    am = logits.argmax(-1).tolist()
    for params in (
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
    ):
        for _trial in range(5):
            metas = [md(params, {i: SequenceData([1])}) for i in range(6)]
            assert tokens(Sampler(EOS)(logits, metas)) == [[t] for t in am]


def test_do_sample_false_and_empty():
    s = Sampler(EOS)
    metas = [md(SamplingParams(), do_sample=False), md(SamplingParams(temperature=0), {5: SequenceData([1])})]
    logits = torch.randn(1, 10)
    outs = s(logits, metas)
    assert outs[0].samples == [] and outs[1].samples[0].output_token == logits[0].argmax().item()
    assert s(torch.empty(0, 10), [md(SamplingParams(), do_sample=False)])[0].samples == []
    assert s(None, []) == []
    with pytest.raises(ValueError):
        s(torch.randn(2, 10), metas)


def test_seeded_reproducible_and_batch_independent():
    torch.manual_seed(3)
    vocab = 64
    row = torch.randn(vocab)
    params = SamplingParams(temperature=1.0, seed=123, top_p=0.95)

    def run_alone(steps=8):
        gen = torch.Generator().manual_seed(123)
        out = []
        for _ in range(steps):
            m = md(params, {7: SequenceData([1])})
            m.generator = gen
            out.append(Sampler(EOS)(row.unsqueeze(0), [m])[0].samples[0].output_token)
        return out

    def run_batched(steps=8):
        gen = torch.Generator().manual_seed(123)
        out = []
        for step in range(steps):
            others = [
                md(SamplingParams(temperature=0.9), {100 + j: SequenceData([1])}) for j in range(step % 3 + 1)
            ]
            m = md(params, {7: SequenceData([1])})
            m.generator = gen
            metas = others[:1] + [m] + others[1:]
            logits = torch.randn(len(metas), vocab)
            logits[1] = row
            out.append(Sampler(EOS)(logits, metas)[1].samples[0].output_token)
        return out

    a = run_alone()
    assert a == run_alone()
    assert a == run_batched()
    assert len(set(a)) > 1  # actually random, not collapsed to argmax


def test_unseeded_rows_use_global_rng():
    logits = torch.zeros(1, 1000)
    torch.manual_seed(5)
    a = tokens(Sampler(EOS)(logits, [md(SamplingParams(temperature=1.0))]))
    torch.manual_seed(5)
    b = tokens(Sampler(EOS)(logits, [md(SamplingParams(temperature=1.0))]))
    assert a == b


def test_num_samples_count_and_parents():
    torch.manual_seed(4)
    logits = torch.randn(3, 200)
    metas = [
        md(SamplingParams(n=4, temperature=1.0), {11: SequenceData([1, 2])}, num_samples=4),
        md(SamplingParams(n=3, temperature=0.0), {12: SequenceData([1])}, num_samples=3),
        md(SamplingParams(n=2, temperature=1.0, seed=1), {13: SequenceData([1])}, num_samples=2, seed_gen=1),
    ]
    outs = Sampler(EOS)(logits[:3], metas)
    assert [len(o.samples) for o in outs] == [4, 3, 2]
    assert all(s.parent_seq_id == 11 for s in outs[0].samples)
    assert all(s.parent_seq_id == 13 for s in outs[2].samples)
    assert [s.output_token for s in outs[1].samples] == [logits[1].argmax().item()] * 3
    # samples are independent draws: with a flat distribution they are almost surely distinct
    flat = torch.zeros(1, 10_000)
    o = Sampler(EOS)(flat, [md(SamplingParams(n=8), num_samples=8)])[0]
    assert len(o.samples) == 8 and len({s.output_token for s in o.samples}) == 8


def test_forked_sequences_each_get_a_row():
    logits = torch.randn(3, 30)
    seqs = {20: SequenceData([1], [4]), 21: SequenceData([1], [5]), 22: SequenceData([1], [6])}
    outs = Sampler(EOS)(logits, [md(SamplingParams(n=3, temperature=0), seqs)])
    assert [s.parent_seq_id for s in outs[0].samples] == [20, 21, 22]
    assert [s.output_token for s in outs[0].samples] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    torch.manual_seed(6)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 20_000
    metas = [md(SamplingParams(temperature=temperature), {i: SequenceData([1])}) for i in range(n)]
    outs = Sampler(None)(base.repeat(n, 1), metas)
    counts = torch.bincount(torch.tensor([o.samples[0].output_token for o in outs]), minlength=5)
    freq = counts.float() / n
    expected = (base / temperature).softmax(-1)
    # std of a frequency is <= 0.5/sqrt(n) ~ 0.0035; 0.015 is > 4 sigma.
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_top_k_top_p_min_p_frequencies():
    torch.manual_seed(7)
    base = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -2.0])
    p = base.softmax(-1)
    n = 20_000

    def freqs(params):
        metas = [md(params, {i: SequenceData([1])}) for i in range(n)]
        outs = Sampler(None)(base.repeat(n, 1), metas)
        c = torch.bincount(torch.tensor([o.samples[0].output_token for o in outs]), minlength=6)
        return c.float() / n

    # top_k=3 -> renormalised over the 3 most likely
    exp = torch.zeros(6)
    exp[:3] = p[:3] / p[:3].sum()
    assert torch.allclose(freqs(SamplingParams(top_k=3)), exp, atol=0.015)
    # top_p: smallest prefix with mass >= top_p
    cum = p.cumsum(0)
    top_p = float(cum[1]) + 0.01  # needs 3 tokens
    exp = torch.zeros(6)
    exp[:3] = p[:3] / p[:3].sum()
    assert torch.allclose(freqs(SamplingParams(top_p=top_p)), exp, atol=0.015)
    # min_p: keep p >= min_p * p_max
    min_p = float(p[3] / p[0]) + 1e-3  # drops token 3 and below
    assert torch.allclose(freqs(SamplingParams(min_p=min_p)), exp, atol=0.015)


def test_apply_top_k_top_p_min_p_masks():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 5.0], [1.0, 2.0, 3.0, 4.0]])
    out = apply_top_k_top_p_min_p(
        logits, torch.tensor([2, -1, 4]), torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0.0, 0.0, 0.0])
    )
    inf = float("-inf")
    assert out[0].tolist() == [3.0, inf, 2.0, inf]
    assert out[1].tolist() == logits[1].tolist() and out[2].tolist() == logits[2].tolist()
    p = logits[2].softmax(-1)  # sorted desc: 4,3,2,1
    top_p = float(p[3] + p[2]) - 1e-4  # first two cover it
    out = apply_top_k_top_p_min_p(logits[2:], torch.tensor([-1]), torch.tensor([top_p]), torch.tensor([0.0]))
    assert out[0].tolist() == [inf, inf, 3.0, 4.0]
    out = apply_top_k_top_p_min_p(
        logits[2:], torch.tensor([-1]), torch.tensor([1.0]), torch.tensor([float(p[1] / p[3]) - 1e-4])
    )
    assert out[0].tolist() == [inf, 2.0, 3.0, 4.0]


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 0.0]])
    prompt, output = [[0, 1]], [[2, 2, 3]]
    out = apply_penalties(
        logits, prompt, output, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25])
    )
    # rep: seen = {0,1,2,3}: 2/2=1, -1*2=-2, 0.5/2=0.25, -0.5*2=-1
    # presence/frequency over output: token 2 count 2 -> -0.5-0.5 ; token 3 count 1 -> -0.5-0.25
    expected = [1.0, -2.0, 0.25 - 1.0, -1.0 - 0.75, 1.0, 0.0]
    assert out[0].tolist() == pytest.approx(expected)
    assert logits[0].tolist() == [2.0, -1.0, 0.5, -0.5, 1.0, 0.0]  # input untouched


def test_penalties_end_to_end_via_logprobs():
    # Vocab 8 and logprobs=8 expose the whole adjusted distribution.
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0, -2.0, 0.0, 1.5]])
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=1.5,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        logprobs=8,
        logit_bias={7: 2.0},
    )
    data = SequenceData([4, 2], [1, 1, 3])
    s = Sampler(EOS)(logits, [md(params, {0: data})])[0].samples[0]
    adj = logits[0].clone()
    adj[4] /= 1.5
    adj[2] *= 1.5
    adj[1] /= 1.5
    adj[3] /= 1.5  # repetition
    adj[1] -= 1.0 + 2 * 0.5
    adj[3] -= 1.0 + 0.5  # presence/frequency
    adj[7] += 2.0  # logit_bias
    lsm = adj.log_softmax(-1)
    assert s.output_token == int(adj.argmax()) == 7
    assert len(s.top_logprobs) == 8
    for t, v in s.top_logprobs.items():
        assert v.logprob == pytest.approx(lsm[t].item(), abs=1e-5)
    assert s.logprob == pytest.approx(lsm[7].item(), abs=1e-5)


def test_penalised_rows_mixed_with_plain_rows():
    torch.manual_seed(8)
    logits = torch.randn(3, 20)
    logits[1, 5] = 10.0
    metas = [
        md(SamplingParams(temperature=0), {0: SequenceData([5])}),
        md(SamplingParams(temperature=0, repetition_penalty=100.0), {1: SequenceData([5])}),
        md(SamplingParams(temperature=0), {2: SequenceData([5])}),
    ]
    outs = Sampler(EOS)(logits, metas)
    assert outs[0].samples[0].output_token == logits[0].argmax().item()
    assert outs[2].samples[0].output_token == logits[2].argmax().item()
    assert outs[1].samples[0].output_token != 5


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.full((1, 10), -5.0)
    logits[0, EOS] = 10.0
    logits[0, 7] = 9.0
    logits[0, 2] = 1.0
    s = Sampler(EOS)
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7, 50])
    assert s(logits, [md(p, {0: SequenceData([1], [4])})])[0].samples[0].output_token == 2
    # enough output tokens -> no suppression
    assert s(logits, [md(p, {0: SequenceData([1], [4, 4])})])[0].samples[0].output_token == EOS
    # ignore_eos: EOS is not suppressed (only stop ids are)
    p2 = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7], ignore_eos=True)
    assert s(logits, [md(p2, {0: SequenceData([1])})])[0].samples[0].output_token == EOS
    # random sampling never picks a suppressed id
    p3 = SamplingParams(temperature=5.0, min_tokens=5, stop_token_ids=[7])
    outs = s(logits.repeat(500, 1), [md(p3, {i: SequenceData([1])}) for i in range(500)])
    toks = {o.samples[0].output_token for o in outs}
    assert EOS not in toks and 7 not in toks and len(toks) > 3
    # logprob of a suppressed token is -inf in the reported distribution
    p4 = SamplingParams(temperature=0, min_tokens=1, logprobs=10)
    top = s(logits, [md(p4)])[0].samples[0].top_logprobs
    assert top[EOS].logprob == float("-inf")


def test_logprobs_size_and_values():
    torch.manual_seed(9)
    logits = torch.randn(4, 50) * 2
    ps = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.8, logprobs=0),
        SamplingParams(temperature=1.3, logprobs=3, top_k=10),
        SamplingParams(temperature=1.0),
    ]
    outs = Sampler(EOS)(logits, [md(p, {i: SequenceData([1])}) for i, p in enumerate(ps)])
    lsm = logits.log_softmax(-1)
    for i, (o, p) in enumerate(zip(outs, ps)):
        s = o.samples[0]
        assert s.logprob == pytest.approx(lsm[i, s.output_token].item(), abs=1e-5)
        if p.logprobs is None:
            assert s.top_logprobs is None
            continue
        top_ids = lsm[i].topk(p.logprobs).indices.tolist() if p.logprobs else []
        assert set(s.top_logprobs) == set(top_ids) | {s.output_token}
        assert p.logprobs <= len(s.top_logprobs) <= p.logprobs + 1
        for t, v in s.top_logprobs.items():
            assert v.logprob == pytest.approx(lsm[i, t].item(), abs=1e-5)
            # rank: 1 + the tokens more likely than it (temperature and top-k do not change it)
            assert v.rank == int((lsm[i] > lsm[i, t]).sum()) + 1
    assert outs[0].samples[0].output_token == logits[0].argmax().item()
    assert len(outs[0].samples[0].top_logprobs) == 5  # greedy token is already in the top 5


def test_logit_bias_forces_token():
    torch.manual_seed(10)
    logits = torch.randn(2, 30)
    for params in (
        SamplingParams(temperature=0, logit_bias={17: 100}),
        SamplingParams(temperature=1.0, logit_bias={17: 100, 999: 5}),
    ):
        outs = Sampler(EOS)(logits, [md(params, {i: SequenceData([1])}) for i in range(2)])
        assert tokens(outs) == [[17], [17]]
    # negative bias bans a token
    logits[0, 4] = 50.0
    out = Sampler(EOS)(logits[:1], [md(SamplingParams(temperature=0, logit_bias={4: -100}))])
    assert out[0].samples[0].output_token != 4


def test_non_float32_logits_and_no_input_mutation():
    torch.manual_seed(11)
    logits = torch.randn(2, 16).to(torch.bfloat16)
    before = logits.clone()
    p = SamplingParams(temperature=0.5, repetition_penalty=1.3, logit_bias={1: 3}, min_tokens=3)
    Sampler(EOS)(logits, [md(p, {i: SequenceData([1, 2], [5])}) for i in range(2)])
    assert torch.equal(logits, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_for_greedy_and_seeded():
    torch.manual_seed(12)
    logits = torch.randn(3, 100)
    ps = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=4, top_k=20),
        SamplingParams(temperature=0, repetition_penalty=1.2, logprobs=3),
    ]

    def run(device):
        metas = [md(p, {i: SequenceData([1, 2])}, seed_gen=4 if p.seed else None) for i, p in enumerate(ps)]
        return Sampler(EOS)(logits.to(device), metas)

    a, b = run("cpu"), run("cuda")
    assert tokens(a) == tokens(b)
    assert math.isclose(a[2].samples[0].logprob, b[2].samples[0].logprob, abs_tol=1e-4)
