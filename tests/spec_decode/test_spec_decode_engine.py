"""Speculative decoding end to end on the tiny random-weight Llama: greedy output with
speculation equals speculation off token for token under every kind of scheduling pressure,
blocks are conserved after every step, and stops / limits / logprobs inside an accepted run
behave as without speculation."""

import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import SamplingParams
from kvserve.config import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sequence import ExecuteModelRequest
from kvserve.spec_decode.interfaces import Proposal, Proposer
from tests.engine.test_e2e_tiny import run_engine

K = 4
MAX_NEW = 48
ENGINE = dict(device="cpu", dtype="float32", seed=0)
#: Repetitive prompts: the tiny model's greedy output repeats parts of them (and of itself)
#: often enough that prompt lookup hits (asserted below: acceptance > 0).
PROMPTS = [
    [7] * 10,
    [100, 200] * 5,
    [11, 12, 13, 14, 15] * 3,
    [3000, 4000, 5000] * 4 + [6000],
    [42] * 3 + [43] * 3 + [42] * 3,
    [900, 901, 902, 903] * 2,
]


def ngram(**kw):
    cfg = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    cfg["disable_below_acceptance_rate"] = 0.0
    cfg.update(kw)
    return cfg


#: The device pool of an engine whose test does not size it (16,384 tokens at the default
#: block size: far more than any test here holds at once). The defaults (1 GiB device pool,
#: 0.5 GiB swap) hold ~200,000 blocks of the tiny model, and ``check_blocks`` walks every block
#: of both pools after every step: that walk was most of these tests' time.
DEFAULT_GPU_BLOCKS = 1024


def pool_sizes(kw: dict) -> dict:
    """``kw`` with ``num_gpu_blocks`` (default ``DEFAULT_GPU_BLOCKS``) and ``num_cpu_blocks``
    (default 4x the device pool: a swap-out never falls back to recompute for want of CPU
    blocks) filled in where unset."""
    kw = dict(kw)
    kw.setdefault("num_gpu_blocks", DEFAULT_GPU_BLOCKS)
    kw.setdefault("num_cpu_blocks", 4 * kw["num_gpu_blocks"])
    return kw


def make_engine(model_dir, spec=None, **kw):
    """An ``LLMEngine`` on ``model_dir`` with ``ENGINE``, ``spec`` and ``kw``, its KV pools sized
    by ``pool_sizes``."""
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(model_dir), **ENGINE, speculative_config=spec, **pool_sizes(kw))
    )
    # speculation on and off are compared on requests that outgrow tiny pools (preempted,
    # recomputed, capped by the scheduler): the engine's admission, which refuses a request whose
    # max_tokens the pool cannot hold, is left out (tests/engine/test_kv_capacity_admission.py)
    engine.kv_capacity = lambda: None  # type: ignore[method-assign]
    return engine


def greedy(max_tokens=MAX_NEW, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def check_blocks(engine):
    bm = engine.scheduler.block_manager
    bm.check_invariants()  # conservation + ref counts == table references, both pools
    st = engine.get_kv_cache_stats()
    assert 0 <= st["num_free_gpu_blocks"] <= st["num_gpu_blocks"]


def drain(engine, requests=(), max_steps=3000, on_step=None):
    """``run_engine`` checking the block tables after every step; returns the final outputs by
    id and the number of steps taken."""
    steps = []

    def each_step(step):
        check_blocks(engine)
        steps.append(step)
        if on_step is not None:
            on_step(step)

    finals = run_engine(engine, requests, max_steps=max_steps, on_step=each_step)
    return finals, len(steps)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Speculation off, roomy cache: request id -> output token ids."""
    eng = make_engine(tiny_llama_dir, num_gpu_blocks=256, block_size=4)
    finals, _ = drain(eng, [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)])
    return {rid: out.outputs[0].token_ids for rid, out in finals.items()}


class OracleProposer(Proposer):
    """Proposes the target's own greedy continuation (computed beforehand): with exact
    verification and KV rollback every draft is accepted."""

    def __init__(self, continuations: dict[tuple, list[int]]):
        self.continuations = continuations
        self.freed: list[int] = []

    def propose(self, req: ExecuteModelRequest, k: int) -> dict[int, Proposal]:
        out = {}
        for md in req.seq_group_metadata_list:
            m = min(k, md.num_speculative_tokens)
            if md.is_prompt or m < 1:
                continue
            for sid, data in md.seq_data.items():
                ref = self.continuations[tuple(data.prompt_token_ids)]
                n = data.get_output_len()
                assert data.output_token_ids == ref[:n], "the sequence left the reference"
                if ref[n : n + m]:
                    out[sid] = Proposal(ref[n : n + m])
        return out

    def free(self, seq_ids):
        self.freed.extend(seq_ids)


def with_oracle(engine, reference):
    oracle = OracleProposer({tuple(p): reference[f"r{i}"] for i, p in enumerate(PROMPTS)})
    engine.executor.proposer = oracle
    return oracle


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_ngram_speculation_equals_off_in_every_mode(tiny_llama_dir, reference, chunked, prefix, mode):
    """Chunked prefill x prefix caching x preemption mode, with a cache small enough to
    preempt: n-gram speculation gives the same tokens as speculation off, drafts are accepted,
    and blocks are conserved after every step."""
    eng = make_engine(
        tiny_llama_dir,
        ngram(),
        block_size=4,
        num_gpu_blocks=40,
        num_cpu_blocks=64,
        preemption_mode=mode,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=prefix,
        max_num_batched_tokens=24 if chunked else None,
    )
    reqs = [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)]

    def later(step):
        # the same prompts again once theirs are computed: prefix-cache hits
        if step == 4:
            eng.add_request("again0", {"prompt_token_ids": PROMPTS[0]}, greedy())
            eng.add_request("again2", {"prompt_token_ids": PROMPTS[2]}, greedy())

    finals, _ = drain(eng, reqs, on_step=later)
    assert len(finals) == len(PROMPTS) + 2
    for rid, out in finals.items():
        assert out.outcome == "finished", (rid, out.error)
        ref = reference["r" + rid[-1]] if rid.startswith("again") else reference[rid]
        assert out.outputs[0].token_ids == ref, rid
    stats = eng.get_kv_cache_stats()
    assert stats["num_preemptions"] > 0, "the tiny cache must force preemption"
    assert eng.stats.spec_num_draft_tokens > 0
    assert eng.stats.spec_num_accepted_tokens > 0, "repetitive prompts must get drafts accepted"
    assert sum(o.spec_num_accepted_tokens for o in finals.values()) == eng.stats.spec_num_accepted_tokens
    if prefix:
        assert stats["prefix_cache_hits"] > 0


def test_target_as_its_own_proposer_accepts_every_draft(tiny_llama_dir, reference):
    """An oracle proposer (the target's own greedy continuation) gets 100% acceptance: the
    verification and the KV rollback are exact. Each step emits K + 1 tokens (fixed k: the
    step count is the point; the dynamic policy may draft fewer where rows are dear)."""
    eng = make_engine(tiny_llama_dir, ngram(dynamic=False), block_size=4, num_gpu_blocks=256)
    oracle = with_oracle(eng, reference)
    finals, steps = drain(eng, [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)])
    for rid, out in finals.items():
        assert out.outputs[0].token_ids == reference[rid]
        assert out.spec_num_draft_tokens > 0
        assert out.spec_num_accepted_tokens == out.spec_num_draft_tokens, rid
    assert eng.stats.spec_acceptance_rate == 1.0
    assert eng.stats.spec_mean_accepted_length > K  # K accepted + the bonus, but the last step
    # one prefill step (first token), then K + 1 tokens per verify step
    assert steps == 1 + -(-(MAX_NEW - 1) // (K + 1))
    assert len(set(oracle.freed)) == len(PROMPTS)  # the proposer hears of every ended sequence


def test_oracle_under_preemption_and_prefix_caching(tiny_llama_dir, reference):
    """Full acceptance also when groups are preempted (recompute) and blocks are shared by the
    prefix cache: rollback never leaves a stale slot that is read later."""
    eng = make_engine(
        tiny_llama_dir,
        ngram(),
        block_size=4,
        num_gpu_blocks=40,
        preemption_mode="recompute",
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=24,
    )
    with_oracle(eng, reference)
    finals, _ = drain(eng, [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)])
    for rid, out in finals.items():
        assert out.outputs[0].token_ids == reference[rid]
        assert out.spec_num_accepted_tokens == out.spec_num_draft_tokens
    assert eng.get_kv_cache_stats()["num_preemptions"] > 0


@pytest.mark.parametrize("cut", [2, 7, 13])
def test_stop_token_id_inside_an_accepted_run(tiny_llama_dir, reference, cut):
    """A stop token id drafted (and accepted) in the middle of a run: the output ends at it
    (included, as without speculation) and nothing after it is emitted."""
    ref = reference["r1"]
    stop_tok = ref[cut]
    first = ref.index(stop_tok)
    assert cut % (K + 1) != K  # not the run's last token
    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=128)
    with_oracle(eng, reference)
    finals, _ = drain(eng, [("r1", PROMPTS[1], greedy(stop_token_ids=[stop_tok]))])
    out = finals["r1"].outputs[0]
    assert out.token_ids == ref[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


@pytest.mark.parametrize("max_tokens", [1, 3, 9, 12])
def test_max_tokens_inside_an_accepted_run(tiny_llama_dir, reference, max_tokens):
    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=128)
    with_oracle(eng, reference)
    finals, _ = drain(eng, [("r2", PROMPTS[2], greedy(max_tokens=max_tokens))])
    out = finals["r2"].outputs[0]
    assert out.token_ids == reference["r2"][:max_tokens]
    assert out.finish_reason == "length"
    # drafts past max_tokens are never proposed
    assert finals["r2"].spec_num_draft_tokens <= max(0, max_tokens - 2)


def test_max_model_len_inside_an_accepted_run(tiny_llama_dir, reference):
    """The context limit falls inside a run: lookahead is clipped, output stops at the limit."""
    prompt = PROMPTS[0]
    limit = len(prompt) + 11
    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=128, max_model_len=limit)
    with_oracle(eng, reference)
    finals, _ = drain(eng, [("r0", prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=11))])
    out = finals["r0"].outputs[0]
    assert out.token_ids == reference["r0"][:11]
    assert out.finish_reason == "length"


def test_stop_string_inside_an_accepted_run(tiny_llama_dir, reference):
    """A stop string completed by a token in the middle of a run: same text and tokens as
    speculation off."""
    eng_off = make_engine(tiny_llama_dir, block_size=4, num_gpu_blocks=128)
    tok = eng_off.tokenizer
    ref = reference["r3"]
    # the text of a token in the middle of a run, that does not occur earlier in the output
    target = None
    for j in range(6, 30):
        piece = tok.decode([ref[j]])
        if len(piece.strip()) >= 2 and piece not in tok.decode(ref[:j]) and j % (K + 1) != K:
            target = piece
            break
    assert target is not None
    params = greedy(stop=[target])
    off, _ = drain(eng_off, [("r3", PROMPTS[3], params)])
    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=128)
    with_oracle(eng, reference)
    on, _ = drain(eng, [("r3", PROMPTS[3], greedy(stop=[target]))])
    a, b = on["r3"].outputs[0], off["r3"].outputs[0]
    assert a.finish_reason == "stop" and a.stop_reason == target
    assert a.text == b.text and target not in a.text
    assert a.token_ids == b.token_ids
    assert on["r3"].spec_num_accepted_tokens > 0


def test_logprobs_for_every_emitted_token(tiny_llama_dir, reference):
    eng_off = make_engine(tiny_llama_dir, block_size=4, num_gpu_blocks=128)
    off, _ = drain(eng_off, [("r4", PROMPTS[4], greedy(logprobs=3))])
    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=128)
    with_oracle(eng, reference)
    on, _ = drain(eng, [("r4", PROMPTS[4], greedy(logprobs=3))])
    a, b = on["r4"].outputs[0], off["r4"].outputs[0]
    assert a.token_ids == b.token_ids == reference["r4"]
    assert len(a.logprobs) == len(a.token_ids)
    for tok, la, lb in zip(a.token_ids, a.logprobs, b.logprobs):
        assert tok in la and set(la) == set(lb)
        for t in la:
            assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-3)
            assert la[t].rank == lb[t].rank and la[t].decoded_token == lb[t].decoded_token
    assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-2)


def test_n_greater_than_one_with_speculation(tiny_llama_dir, reference):
    """n > 1 groups speculate in lockstep (each sample emits as many tokens as the one that
    accepted fewest); their output is unchanged, beside a single-sequence request."""
    eng_off = make_engine(tiny_llama_dir, block_size=4, num_gpu_blocks=128)
    params = dict(n=2, temperature=0.0, ignore_eos=True, max_tokens=20)
    off, _ = drain(eng_off, [("multi", PROMPTS[2], SamplingParams(**params))])
    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=128)
    with_oracle(eng, reference)
    on, _ = drain(eng, [("multi", PROMPTS[2], SamplingParams(**params)), ("r0", PROMPTS[0], greedy())])
    assert [c.token_ids for c in on["multi"].outputs] == [c.token_ids for c in off["multi"].outputs]
    assert on["multi"].outputs[0].token_ids == reference["r2"][:20]
    assert on["multi"].spec_num_accepted_tokens > 0
    assert on["r0"].outputs[0].token_ids == reference["r0"]
    assert on["r0"].spec_num_accepted_tokens > 0


def test_abort_mid_run_frees_everything(tiny_llama_dir, reference):
    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=64)
    with_oracle(eng, reference)

    def abort_some(step):
        if step == 3:
            eng.abort_request(["r1", "r3"])

    finals, _ = drain(eng, [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)], on_step=abort_some)
    assert finals["r1"].outcome == finals["r3"].outcome == "aborted"
    for rid in ("r0", "r2", "r4", "r5"):
        assert finals[rid].outcome == "finished"
        assert finals[rid].outputs[0].token_ids == reference[rid]
    # an aborted request's tokens are a prefix of its reference
    for rid in ("r1", "r3"):
        toks = finals[rid].outputs[0].token_ids
        assert 0 < len(toks) < MAX_NEW and toks == reference[rid][: len(toks)]


def test_disable_by_batch_size(tiny_llama_dir, reference):
    """More running sequences than ``disable_by_batch_size``: no step speculates (no lookahead
    slot reserved); alone, a request speculates."""
    eng = make_engine(tiny_llama_dir, ngram(disable_by_batch_size=2), block_size=4, num_gpu_blocks=128)
    with_oracle(eng, reference)
    seen = []
    orig = eng.scheduler.schedule

    def schedule():
        metas, out = orig()
        running = sum(g.num_unfinished_seqs() for g in eng.scheduler.running)
        seen.append((running, max((m.num_speculative_tokens for m in metas), default=0)))
        return metas, out

    eng.scheduler.schedule = schedule
    reqs = [(f"r{i}", PROMPTS[i], greedy(max_tokens=MAX_NEW)) for i in (0, 1, 2)]
    finals, _ = drain(eng, reqs)
    assert sum(o.spec_num_draft_tokens for o in finals.values()) == 0
    assert all(k == 0 for _, k in seen)
    for rid, out in finals.items():
        assert out.outputs[0].token_ids == reference[rid]
    # two requests (== the limit) speculate
    finals, _ = drain(eng, [(f"r{i}", PROMPTS[i], greedy()) for i in (3, 4)])
    assert all(o.spec_num_accepted_tokens > 0 for o in finals.values())


def test_low_acceptance_switches_a_request_off(tiny_llama_dir, reference):
    """A request whose acceptance stays below ``disable_below_acceptance_rate`` pauses
    speculating after ``acceptance_window`` drafted tokens; the output is unchanged (fixed k:
    the rule needs drafts to judge, which the dynamic policy may withhold on the tiny model)."""
    spec = ngram(disable_below_acceptance_rate=0.99, acceptance_window=K, dynamic=False)
    eng = make_engine(tiny_llama_dir, spec, block_size=4, num_gpu_blocks=128)
    free_run = make_engine(tiny_llama_dir, ngram(dynamic=False), block_size=4, num_gpu_blocks=128)
    ids = [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)]
    finals, _ = drain(eng, ids)
    unlimited, _ = drain(free_run, ids)
    switched = 0
    for rid, out in finals.items():
        assert out.outputs[0].token_ids == reference[rid]
        u = unlimited[rid]
        if u.spec_num_accepted_tokens < 0.99 * u.spec_num_draft_tokens and u.spec_num_draft_tokens >= 2 * K:
            # the window closed with a rate under the floor: speculation paused (resuming
            # later, so a request that drafts rarely may draft as often as without the rule)
            assert out.spec_num_draft_tokens <= u.spec_num_draft_tokens, rid
            switched += out.spec_num_draft_tokens < u.spec_num_draft_tokens
    assert switched > 0


class _WrongThenRight(Proposer):
    """Wrong drafts (the oracle's, each id + 1) while the sequence has fewer than ``switch``
    output tokens, the oracle's own after (``right_first``: the other way round); records the
    output length at every proposal."""

    def __init__(self, oracle, switch, right_first=False):
        self.oracle, self.switch, self.right_first, self.proposed_at = oracle, switch, right_first, []

    def propose(self, req, k):
        out = self.oracle.propose(req, k)
        for md in req.seq_group_metadata_list:
            for sid, data in md.seq_data.items():
                if sid in out:
                    n = data.get_output_len()
                    self.proposed_at.append(n)
                    if (n < self.switch) != self.right_first:
                        out[sid] = Proposal([t + 1 for t in out[sid].token_ids])
        return out


def test_low_acceptance_pauses_a_request_and_it_resumes(tiny_llama_dir, reference):
    """A request whose acceptance is below ``disable_below_acceptance_rate`` over
    ``acceptance_window`` drafted tokens pauses speculation for ``acceptance_window *
    2**pauses`` output tokens, then speculates again and is judged afresh: drafts that turn
    good are used (a request that starts in its own words and then quotes its input)."""
    window = K
    spec = ngram(disable_below_acceptance_rate=0.5, acceptance_window=window, dynamic=False)
    eng = make_engine(tiny_llama_dir, spec, block_size=4, num_gpu_blocks=128)
    oracle = OracleProposer({tuple(p): reference[f"r{i}"] for i, p in enumerate(PROMPTS)})
    prop = eng.executor.proposer = _WrongThenRight(oracle, switch=12)
    finals, _ = drain(eng, [("r0", PROMPTS[0], greedy())])
    out = finals["r0"]
    assert out.outputs[0].token_ids == reference["r0"]
    at = prop.proposed_at
    # a wrong window (K drafts at output 1, one token emitted), then a pause of K tokens;
    # wrong again, a pause of 2K: the pauses double while the drafts are wrong
    wrong = [n for n in at if n < 12]
    assert wrong[0] == 1 and len(wrong) >= 2, at
    gaps = [b - a for a, b in zip(wrong, wrong[1:])]
    assert gaps == [1 + window * 2**i for i in range(len(gaps))], at
    # once right, drafts come every step (K accepted, K + 1 emitted) until max_tokens
    right = [n for n in at if n >= 12]
    assert right and all(b - a == K + 1 for a, b in zip(right, right[1:])), at
    assert out.spec_num_accepted_tokens >= (MAX_NEW - right[0]) * K // (K + 1) - K


class _WrongInPhases(Proposer):
    """The oracle's drafts, wrong (each id + 1) while the sequence's output length is in
    ``[0, 10)`` mod 20: a request pauses, resumes into wrong drafts, pauses longer, and resumes
    into right ones."""

    def __init__(self, oracle):
        self.oracle = oracle

    def propose(self, req, k):
        out = self.oracle.propose(req, k)
        for md in req.seq_group_metadata_list:
            for sid, data in md.seq_data.items():
                if sid in out and data.get_output_len() % 20 < 10:
                    out[sid] = Proposal([t + 1 for t in out[sid].token_ids])
        return out


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_paused_requests_under_preemption_abort_and_parallel_samples(tiny_llama_dir, reference, mode):
    """Low-acceptance pauses beside preemption (a cache too small for the batch), an n = 2
    request (its samples' drafts judged together) and a request aborted while paused: every
    answer equals speculation off, blocks are conserved after every step (``drain``), and every
    request that finishes had drafts accepted, which it only gets after resuming (its first
    drafts are all wrong)."""
    spec = ngram(disable_below_acceptance_rate=0.5, acceptance_window=2, dynamic=False)
    eng = make_engine(
        tiny_llama_dir, spec, block_size=4, num_gpu_blocks=40, num_cpu_blocks=64, preemption_mode=mode
    )
    oracle = OracleProposer({tuple(p): reference[f"r{i}"] for i, p in enumerate(PROMPTS)})
    eng.executor.proposer = _WrongInPhases(oracle)
    pauses = {}

    def watch(step):
        for g in [*eng.scheduler.running, *eng.scheduler.waiting, *eng.scheduler.swapped]:
            pauses[g.request_id] = max(pauses.get(g.request_id, 0), g.spec_num_pauses)
            if g.request_id == "r3" and g.spec_decode_disabled:
                eng.abort_request("r3")

    multi = SamplingParams(n=2, temperature=0.0, ignore_eos=True, max_tokens=40)
    reqs = [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)] + [("multi", PROMPTS[2], multi)]
    finals, _ = drain(eng, reqs, on_step=watch)
    assert finals["r3"].outcome == "aborted"
    for rid, out in finals.items():
        if rid == "r3":
            continue
        assert out.outcome == "finished", (rid, out.error)
        ref = reference["r2"][:40] if rid == "multi" else reference[rid]
        assert [c.token_ids for c in out.outputs] == [ref] * len(out.outputs), rid
        assert pauses[rid] >= 2 and out.spec_num_accepted_tokens > 0, (rid, pauses)
    assert eng.get_kv_cache_stats()["num_preemptions"] > 0


def test_acceptance_is_judged_per_window_not_over_the_requests_life(tiny_llama_dir, reference):
    """A request that accepted every draft so far and then stops accepting pauses after one
    window of ``acceptance_window`` bad drafts, not once its lifetime rate has fallen."""
    spec = ngram(disable_below_acceptance_rate=0.5, acceptance_window=K, dynamic=False)
    eng = make_engine(tiny_llama_dir, spec, block_size=4, num_gpu_blocks=128)
    oracle = OracleProposer({tuple(p): reference[f"r{i}"] for i, p in enumerate(PROMPTS)})
    prop = eng.executor.proposer = _WrongThenRight(oracle, switch=16, right_first=True)
    finals, _ = drain(eng, [("r0", PROMPTS[0], greedy())])
    assert finals["r0"].outputs[0].token_ids == reference["r0"]
    at = prop.proposed_at
    right = [n for n in at if n < 16]
    wrong = [n for n in at if n >= 16]
    assert len(right) >= 3, at  # K accepted each: the lifetime rate stays >= 0.5 for 3 windows
    # the first bad window pauses K tokens: the next proposal is 1 + K tokens later
    assert wrong[1] - wrong[0] == 1 + K, at


def test_structured_output_requests_speculate(tiny_llama_dir):
    """Constrained requests speculate too (their drafts checked against the grammar: see
    test_spec_decode_structured.py)."""
    from kvserve.sampling_params import StructuredOutputsParams

    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=128)
    params = greedy(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="(ab)+"))
    params.ignore_eos = False
    finals, _ = drain(eng, [("c", [100, 200] * 5, params)])
    assert finals["c"].spec_num_draft_tokens > 0
    assert (
        re.fullmatch("(ab)+", finals["c"].outputs[0].text) or finals["c"].outputs[0].finish_reason == "length"
    )
    assert finals["c"].outputs[0].text.startswith("ab")


def _rejection_sampler_available() -> bool:
    import torch

    from kvserve.spec_decode.rejection_sampler import rejection_sample

    try:
        rejection_sample(torch.full((1, 2, 4), 0.25), torch.zeros(1, 1, dtype=torch.long), None, [None])
    except NotImplementedError:
        return False
    return True


def test_seeded_sampling_with_speculation_is_reproducible(tiny_llama_dir):
    if not _rejection_sampler_available():
        pytest.skip("rejection_sample is not implemented on this branch")
    outs = []
    for _ in range(2):
        eng = make_engine(tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=128)
        params = SamplingParams(max_tokens=30, temperature=0.8, seed=123, ignore_eos=True, logprobs=0)
        finals, _ = drain(eng, [("s", PROMPTS[1], params)])
        out = finals["s"].outputs[0]
        assert len(out.logprobs) == len(out.token_ids) == 30
        outs.append(out.token_ids)
    assert outs[0] == outs[1]


class _Corrupting(Proposer):
    """The oracle's drafts with a random tail of garbage (random ids), random lengths."""

    def __init__(self, oracle, rng, vocab):
        self.oracle, self.rng, self.vocab = oracle, rng, vocab

    def propose(self, req, k):
        out = self.oracle.propose(req, k)
        for sid, p in out.items():
            keep = self.rng.randint(0, len(p.token_ids))
            garbage = [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(0, k))]
            out[sid] = Proposal((p.token_ids[:keep] + garbage)[: self.rng.randint(1, k)])
        return out


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    chunked=st.booleans(),
    prefix=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
    k=st.integers(1, 6),
)
def test_any_drafts_leave_greedy_output_unchanged(tiny_llama_dir, reference, seed, chunked, prefix, mode, k):
    """Fuzz: drafts that are partly right and partly random, of random lengths, under a tiny
    cache in any mode, never change the greedy output; blocks are conserved every step."""
    import random

    eng = make_engine(
        tiny_llama_dir,
        ngram(num_speculative_tokens=k),
        block_size=4,
        num_gpu_blocks=40,
        num_cpu_blocks=64,
        preemption_mode=mode,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=prefix,
        max_num_batched_tokens=24 if chunked else None,
    )
    oracle = OracleProposer({tuple(p): reference[f"r{i}"] for i, p in enumerate(PROMPTS)})
    eng.executor.proposer = _Corrupting(oracle, random.Random(seed), 49152)
    finals, _ = drain(eng, [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)])
    for rid, out in finals.items():
        assert out.outputs[0].token_ids == reference[rid], rid
    assert eng.stats.spec_num_accepted_tokens > 0


class _Broken(Proposer):
    def __init__(self, how):
        self.how = how

    def apply_block_moves(self, req):
        if self.how == "hooks_raise":
            raise RuntimeError("proposer bug")

    def on_verified(self, num_accepted):
        if self.how == "hooks_raise":
            raise RuntimeError("proposer bug")

    def free(self, seq_ids):
        if self.how == "hooks_raise":
            raise RuntimeError("proposer bug")

    def propose(self, req, k):
        if self.how == "raises":
            raise RuntimeError("proposer bug")
        bad = {"hooks_raise": [5, 6], "out_of_vocab": [49152 + 5], "negative": [-1], "bad_probs": [5]}[
            self.how
        ]
        probs = None
        if self.how == "bad_probs":
            import torch

            probs = torch.zeros(1, 7)
        return {
            sid: Proposal(bad, probs)
            for md in req.seq_group_metadata_list
            if md.num_speculative_tokens
            for sid in md.seq_data
        }


@pytest.mark.parametrize("how", ["raises", "hooks_raise", "out_of_vocab", "negative", "bad_probs"])
def test_a_broken_proposer_never_costs_a_request_its_answer(tiny_llama_dir, reference, how):
    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=128)
    eng.executor.proposer = _Broken(how)
    finals, _ = drain(eng, [(f"r{i}", p, greedy(max_tokens=12)) for i, p in enumerate(PROMPTS[:3])])
    for rid, out in finals.items():
        assert out.outcome == "finished"
        assert out.outputs[0].token_ids == reference[rid][:12]
        # malformed drafts are dropped; well-formed ones are verified even when hooks fail
        assert (out.spec_num_draft_tokens > 0) == (how == "hooks_raise")


def test_priority_preemption_with_speculation(tiny_llama_dir, reference):
    """Under the priority policy, late high-priority requests preempt running speculating ones;
    every answer is unchanged."""
    eng = make_engine(
        tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=40, num_cpu_blocks=64, policy="priority"
    )
    with_oracle(eng, reference)
    first = [(f"r{i}", PROMPTS[i], greedy()) for i in (0, 1, 2, 3)]

    def later(step):
        if step == 3:
            for i in (4, 5):
                eng.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[i]}, greedy(), priority=-1)

    for rid, ids, params in first:
        eng.add_request(rid, {"prompt_token_ids": ids}, params, priority=5)
    finals, _ = drain(eng, on_step=later)
    assert sorted(finals) == [f"r{i}" for i in range(6)]
    for rid, out in finals.items():
        assert out.outputs[0].token_ids == reference[rid], rid
    assert eng.get_kv_cache_stats()["num_preemptions"] > 0


def test_sampling_rows_go_to_rejection_sample_with_padding_and_generators(
    tiny_llama_dir, reference, monkeypatch
):
    """The worker's side of the rejection-sampler contract: padded [B, k+1, V] target
    probabilities (each row a distribution), the drafts, None draft probs for n-gram, per-row
    draft counts and the request's own generator; what it returns is emitted as is."""
    import torch

    from kvserve.spec_decode import spec_decode_worker

    calls = []

    def fake(
        target_probs, draft_token_ids, draft_probs, generators, num_draft_tokens=None, draws_per_row=None
    ):
        assert draws_per_row == K  # every row draws for k drafts, whatever the step's largest
        B, k1, V = target_probs.shape
        assert draft_token_ids.shape == (B, k1 - 1) and draft_probs is None
        assert len(generators) == B and num_draft_tokens.shape == (B,)
        for b in range(B):
            m = int(num_draft_tokens[b])
            assert torch.allclose(target_probs[b, : m + 1].sum(-1), torch.ones(m + 1), atol=1e-4)
        calls.append((num_draft_tokens.tolist(), [g is not None for g in generators]))
        # accept every draft, then emit the target's most likely token as the "bonus"
        tokens = torch.full((B, k1), -1, dtype=torch.long)
        for b in range(B):
            m = int(num_draft_tokens[b])
            tokens[b, :m] = draft_token_ids[b, :m]
            tokens[b, m] = target_probs[b, m].argmax()
        return tokens, num_draft_tokens.clone()

    monkeypatch.setattr(spec_decode_worker, "rejection_sample", fake)
    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=128)
    with_oracle(eng, reference)
    # top_k=1: the sampling distribution is a point mass on the argmax, so the fake's choices
    # equal greedy decoding and the output can be checked against the reference
    params = [
        SamplingParams(max_tokens=20, temperature=0.5, top_k=1, ignore_eos=True, seed=7 if i == 0 else None)
        for i in range(2)
    ]
    finals, _ = drain(eng, [(f"r{i}", PROMPTS[i], params[i]) for i in range(2)])
    for i in range(2):
        out = finals[f"r{i}"]
        assert out.outputs[0].token_ids == reference[f"r{i}"][:20]
        assert out.spec_num_accepted_tokens == out.spec_num_draft_tokens > 0
    assert calls and any(len(c[0]) == 2 for c in calls)
    assert all(c[1] == [True, False] for c in calls if len(c[0]) == 2)  # r0 is seeded


def test_samples_of_one_group_accepting_different_counts_stay_in_lockstep(
    tiny_llama_dir, reference, monkeypatch
):
    """n = 2 sampled: when the rejection sampler accepts different numbers of drafts for the two
    samples, both emit as many tokens as the shorter one; lengths stay equal every step."""
    import random

    import torch

    from kvserve.spec_decode import spec_decode_worker

    rng = random.Random(3)

    def fake(
        target_probs, draft_token_ids, draft_probs, generators, num_draft_tokens=None, draws_per_row=None
    ):
        B, k1, _ = target_probs.shape
        tokens = torch.full((B, k1), -1, dtype=torch.long)
        acc = torch.zeros(B, dtype=torch.long)
        for b in range(B):
            # different counts for the two samples, never none (a policy that sees nothing
            # accepted stops drafting, and the test would check no verification at all)
            n = int(num_draft_tokens[b])
            a = rng.randint(min(n, 1), n)
            tokens[b, :a] = draft_token_ids[b, :a]
            tokens[b, a] = target_probs[b, a].argmax()  # top_k=1: the only token it may draw
            acc[b] = a
        return tokens, acc

    monkeypatch.setattr(spec_decode_worker, "rejection_sample", fake)
    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=128)
    with_oracle(eng, reference)

    def lockstep(_):
        for g in eng.scheduler.running:
            assert len({s.get_len() for s in g.get_unfinished_seqs()}) == 1

    params = SamplingParams(n=2, max_tokens=30, temperature=1.0, top_k=1, ignore_eos=True, logprobs=0)
    finals, _ = drain(eng, [("m", PROMPTS[2], params)], on_step=lockstep)
    out = finals["m"]
    for c in out.outputs:
        assert c.token_ids == reference["r2"][:30]
        assert len(c.logprobs) == 30
    assert 0 < out.spec_num_accepted_tokens < out.spec_num_draft_tokens


class _FixedCost:
    """A step-cost model frozen at ``a + b * rows`` (learning disabled), so the dynamic
    policy's choices depend on the acceptance estimates only, not on this machine's timings.
    ``b = None``: ``e ** rows``, where every extra row multiplies the cost by e and no draft
    can pay (k drafts add at most k tokens to n >= 1: ``1 + k / n < e ** k``)."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def observe(self, rows, seconds, prefill=False):
        pass

    def cost(self, rows, prefill=False):
        if self.b is None:
            return math.exp(min(rows, 700))
        return self.a + self.b * rows


@pytest.mark.parametrize("row_cost", [0.0, 0.12, None])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_dynamic_per_sequence_draft_lengths_keep_greedy_output_and_blocks_exact(
    tiny_llama_dir, reference, row_cost, mode
):
    """The dynamic policy gives different sequences different draft lengths in one step
    (0 included) under preemption: greedy output still equals speculation off, blocks are
    conserved every step, no sequence gets more drafts than its slots; rows that cost more
    than drafts return mean nothing is drafted at all."""
    eng = make_engine(
        tiny_llama_dir,
        ngram(),
        block_size=4,
        num_gpu_blocks=40,
        num_cpu_blocks=64,
        preemption_mode=mode,
    )
    pol = eng.executor.policy
    assert pol is not None  # dynamic is the default
    pol.cost_model = _FixedCost(1.0, row_cost)
    seen: list[dict[int, int]] = []
    seen_caps: list[dict[int, int]] = []
    real_allocate = pol._allocate

    def recording(metas, cands, pinned_rows=0):
        ks = real_allocate(metas, cands, pinned_rows)
        for c in cands:
            assert 0 <= ks[c.seq_id] <= c.max_drafts <= K
        seen.append(ks)
        seen_caps.append({c.seq_id: c.max_drafts for c in cands})
        return ks

    pol._allocate = recording
    finals, _ = drain(eng, [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)])
    for rid, out in finals.items():
        assert out.outputs[0].token_ids == reference[rid], rid
    drafted = sum(out.spec_num_draft_tokens for out in finals.values())
    if row_cost is None:
        assert drafted == 0 and all(sum(ks.values()) == 0 for ks in seen)
    elif row_cost == 0.0:
        # free rows: every matched sequence drafts its whole proposal
        assert drafted > 0 and pol.mean_draft_length >= 1.0
        assert all(ks[c] == n for ks, n_by in zip(seen, seen_caps) for c, n in n_by.items())
    else:
        assert drafted > 0
        # some step split its drafts: one sequence drafted, another in the same step did not
        assert any(len(set(ks.values())) > 1 for ks in seen)
    assert eng.stats.spec_num_draft_opportunities > 0
    assert 0.0 <= eng.stats.spec_mean_draft_length <= K


def test_dynamic_false_keeps_the_fixed_k_behaviour(tiny_llama_dir, reference):
    eng = make_engine(tiny_llama_dir, ngram(dynamic=False), block_size=4, num_gpu_blocks=128)
    assert eng.executor.policy is None
    finals, _ = drain(eng, [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)])
    for rid, out in finals.items():
        assert out.outputs[0].token_ids == reference[rid], rid
    assert sum(out.spec_num_draft_tokens for out in finals.values()) > 0


@pytest.mark.parametrize("dynamic", [True, False])
def test_steps_never_cross_the_kernel_row_limit(tiny_llama_dir, reference, dynamic):
    """Where the target's kernels change past some row count (bfloat16: AMX tiles or panels up
    to 64 / 16 rows, oneDNN above, which rounds differently), a speculative step keeps its rows
    within it: the drafts are cut, and a step whose plain rows already exceed it verifies
    nothing; greedy output equals speculation off and drafts are still accepted."""
    eng = make_engine(tiny_llama_dir, ngram(dynamic=dynamic), block_size=4, num_gpu_blocks=128)
    ex = eng.executor
    if dynamic:
        ex.policy.cost_model = _FixedCost(1.0, 0.0)  # free rows: the cap is what limits drafts
    cap = len(PROMPTS) + 3
    ex._row_cap = (cap,)
    runner = ex.worker.runner
    real_forward = runner.forward
    seen: list[tuple[int, int, bool]] = []  # (rows, plain rows, has a verify chunk)

    def forward(metas, caches):
        rows = sum(md.token_chunk_size * len(md.seq_data) for md in metas)
        plain = sum((md.token_chunk_size if md.is_prompt else 1) * len(md.seq_data) for md in metas)
        seen.append((rows, plain, rows > plain))
        return real_forward(metas, caches)

    runner.forward = forward
    finals, _ = drain(eng, [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)])
    for rid, out in finals.items():
        assert out.outputs[0].token_ids == reference[rid], rid
    assert all(rows <= cap for rows, _, verify in seen if verify)
    assert any(verify and rows == cap for rows, _, verify in seen)  # drafts were cut to fit
    assert any(plain > cap for _, plain, _ in seen)  # (the prefill steps) ...
    assert not any(verify for _, plain, verify in seen if plain >= cap)  # ... verified nothing
    assert sum(out.spec_num_accepted_tokens for out in finals.values()) > 0


def test_uniform_kernel_rows_is_the_smallest_switching_weight():
    from types import SimpleNamespace

    import torch

    from kvserve.model_executor.models.cpu_decode_step import uniform_kernel_rows
    from kvserve.ops import gemm, gemm_bf16dot

    def panel(max_rows=None):
        w = torch.randn(48, 32)
        return gemm.PanelWeight(w, large=None if max_rows is None else w, max_rows=max_rows)

    def model(head, down):
        layer = SimpleNamespace(
            self_attn=SimpleNamespace(qkv_weight=panel(), o_weight=panel()),
            mlp=SimpleNamespace(gate_up_weight=panel(), down_weight=down),
        )
        return SimpleNamespace(lm_head=head, layers=[layer, layer])

    assert uniform_kernel_rows(model(panel(), panel())) is None  # float32 panels: any rows
    assert uniform_kernel_rows(model(panel(), panel(16))) == 16
    assert uniform_kernel_rows(model(panel(24), panel(16))) == 16
    assert uniform_kernel_rows(model(torch.randn(48, 32), panel())) is None  # plain / oneDNN
    dot = gemm_bf16dot.DotWeight(torch.randn(48, 32).bfloat16())
    assert uniform_kernel_rows(model(dot, dot)) is None  # the dot-product GEMM: any rows
