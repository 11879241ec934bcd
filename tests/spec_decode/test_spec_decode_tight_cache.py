"""Speculation under tiny KV caches: it never caps or rejects a request that fits without it;
with drafts always rejected or always accepted, every answer and finish reason equals
speculation off."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import SamplingParams
from kvserve.spec_decode.interfaces import Proposal, Proposer
from tests.spec_decode.test_spec_decode_engine import drain, make_engine, ngram

VOCAB = 49152


class _Reference(Proposer):
    """Proposes from known continuations (prompt -> speculation-off output): the true next
    tokens (``wrong=False``: all accepted) or a first draft that is never the target's
    (``wrong=True``: all rejected)."""

    def __init__(self, continuations, wrong):
        self.continuations, self.wrong = continuations, wrong

    def propose(self, req, k):
        out = {}
        for md in req.seq_group_metadata_list:
            m = min(k, md.num_speculative_tokens)
            if md.is_prompt or m < 1:
                continue
            for sid, data in md.seq_data.items():
                ref = self.continuations.get(tuple(data.prompt_token_ids))
                n = data.get_output_len()
                if ref is None or data.output_token_ids != ref[:n] or len(ref) <= n:
                    continue
                if self.wrong:
                    out[sid] = Proposal([(ref[n] + 1) % VOCAB] * m)
                else:
                    out[sid] = Proposal(ref[n : n + m])
        return out


def _run(model_dir, spec, kw, reqs, proposer=None):
    eng = make_engine(model_dir, spec, **kw)
    if proposer is not None:
        eng.executor.proposer = proposer
    result = {}
    for rid, prompt, sp in reqs:
        try:
            eng.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(**sp))
        except ValueError as e:
            result[rid] = ("rejected", str(e))
    finals, steps = drain(eng, [])
    for rid, out in finals.items():
        result[rid] = (out.outcome, [(c.token_ids, c.finish_reason) for c in out.outputs])
    s = eng.scheduler
    return result, finals, steps, (s.num_recompute_preemptions, s.num_swap_preemptions)


def test_n2_under_a_tight_prefix_cache_is_not_capped_earlier_than_without_speculation(tiny_llama_dir):
    """Greedy n=2 samples are identical, so prefix caching deduplicates their full blocks; the
    blocks an accepted run completes must be deduplicated before the next step is scheduled,
    else the group holds twice the blocks and is length-capped early."""
    kw = dict(block_size=2, num_gpu_blocks=7, enable_prefix_caching=True, enable_chunked_prefill=True)
    reqs = [("r", [17, 4, 17], dict(max_tokens=18, n=2, temperature=0.0, ignore_eos=True))]
    off, finals, _, _ = _run(tiny_llama_dir, None, kw, reqs)
    cont = {(17, 4, 17): finals["r"].outputs[0].token_ids}
    on, on_finals, _, _ = _run(tiny_llama_dir, ngram(), kw, reqs, _Reference(cont, wrong=False))
    assert on_finals["r"].spec_num_accepted_tokens > 0
    assert [len(t) for t, _ in on["r"][1]] == [len(t) for t, _ in off["r"][1]]
    assert on == off


def test_accepted_run_enters_its_completed_blocks_in_the_prefix_cache_at_once(tiny_llama_dir):
    """After every step, every full computed block of a speculating sequence is registered."""
    kw = dict(block_size=2, num_gpu_blocks=64, enable_prefix_caching=True)
    prompt = [5, 6, 7]
    _, finals, _, _ = _run(
        tiny_llama_dir, None, kw, [("r", prompt, dict(max_tokens=20, temperature=0.0, ignore_eos=True))]
    )
    eng = make_engine(tiny_llama_dir, ngram(), **kw)
    eng.executor.proposer = _Reference({tuple(prompt): finals["r"].outputs[0].token_ids}, wrong=False)
    eng.add_request(
        "r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    )
    bm = eng.scheduler.block_manager
    checked = 0
    for _ in range(40):
        if not eng.has_unfinished_requests():
            break
        eng.step()
        for g in eng.scheduler.running:
            for s in g.get_unfinished_seqs():
                assert bm._num_marked.get(s.seq_id, 0) == s.data.get_num_computed_tokens() // 2
                checked += 1
    assert checked > 0


def _case(seed):
    rng = random.Random(seed)
    chunked = rng.random() < 0.5
    kw = dict(
        block_size=rng.choice([2, 4]),
        num_gpu_blocks=rng.randint(3, 10),
        num_cpu_blocks=32,
        preemption_mode=rng.choice(["recompute", "swap"]),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=rng.random() < 0.5,
        max_num_batched_tokens=16 if chunked else None,
    )
    if rng.random() < 0.5:
        kw["max_model_len"] = rng.randint(6, 30)
    reqs = []
    for i in range(rng.randint(1, 5)):
        base = [rng.randrange(3, 50) for _ in range(rng.randint(1, 3))]
        prompt = (base * 20)[: rng.randint(1, 20)]
        sp = dict(max_tokens=rng.randint(1, 40), n=rng.choice([1, 1, 2]), temperature=0.0, ignore_eos=True)
        reqs.append((f"r{i}", prompt, sp))
    return kw, reqs, rng.randint(1, 8)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 100_000))
def test_speculation_under_a_tiny_cache_changes_nothing_but_speed(tiny_llama_dir, seed):
    """Fuzz over tiny caches, context limits, modes and n: with drafts always rejected or
    always accepted, every request ends as with speculation off (same outcome, tokens and
    finish reasons: never an earlier cap or a rejection)."""
    kw, reqs, k = _case(seed)
    off, finals, _, _ = _run(tiny_llama_dir, None, kw, reqs)
    cont = {tuple(p): finals[rid].outputs[0].token_ids for rid, p, _ in reqs if rid in finals}
    spec = ngram(num_speculative_tokens=k)
    wrong, _, _, _ = _run(tiny_llama_dir, spec, kw, reqs, _Reference(cont, wrong=True))
    assert wrong == off, (kw, reqs)
    right, _, _, _ = _run(tiny_llama_dir, spec, kw, reqs, _Reference(cont, wrong=False))
    assert right == off, (kw, reqs)


@pytest.mark.parametrize("wrong", [True, False])
def test_fuzz_seed_707_ends_every_request_as_speculation_off(tiny_llama_dir, wrong):
    """A fuzz case (n=2 groups in 10 blocks of 4, chunked prefill, recompute) with two faults.
    Rejected drafts: their lookahead blocks, still held, made r3 look like it could never take
    its next token (capped after 12 tokens instead of 16). Accepted drafts: r4, preempted at
    another point than with speculation off, shared fewer blocks between its two identical
    sequences and was capped after 17 tokens instead of 21 (the cap depended on history)."""
    kw, reqs, k = _case(707)
    off, finals, _, _ = _run(tiny_llama_dir, None, kw, reqs)
    cont = {tuple(p): finals[rid].outputs[0].token_ids for rid, p, _ in reqs if rid in finals}
    on, _, _, _ = _run(tiny_llama_dir, ngram(num_speculative_tokens=k), kw, reqs, _Reference(cont, wrong))
    assert on == off


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forked_sequences_that_agree_are_recomputed_to_share_blocks_not_capped(tiny_llama_dir, mode):
    """Greedy n=2 forks after its one-block prompt, so its two identical sequences hold their
    own copies of every later block: 1 + 7 + 7 blocks for 31 tokens, more than the 10 in the
    cache. Re-prefilled they share every full block, so the group is recomputed (in either
    mode) instead of being length-capped, and ends with all its tokens."""
    reqs = [("r", [34, 31, 34, 31], dict(max_tokens=27, n=2, temperature=0.0, ignore_eos=True))]
    big, _, _, _ = _run(tiny_llama_dir, None, dict(block_size=4, num_gpu_blocks=64), reqs)
    kw = dict(block_size=4, num_gpu_blocks=10, num_cpu_blocks=32, preemption_mode=mode)
    small, _, _, (recomputes, _) = _run(tiny_llama_dir, None, kw, reqs)
    assert [len(t) for t, _ in small["r"][1]] == [27, 27]
    assert small == big
    assert recomputes >= 1


def test_a_forked_group_that_cannot_swap_back_in_is_recomputed_not_capped(tiny_llama_dir):
    """Swap mode: greedy n=3 'a' (three identical sequences, each with its own copy of every
    block after the prompt) is swapped out as the victim of the older 'b' while it holds 4 of
    the 6 blocks; swapping back in needs those 4 plus 3 for its next token, more than the
    cache. Re-prefilled it shares its identical blocks, so it is recomputed, as when it outgrows
    the cache while running, and ends as it does alone (13 tokens), not capped after 5: the
    cap must not depend on which group was preempted when."""
    a = ("a", [34, 31, 34, 31], dict(max_tokens=40, n=3, temperature=0.0, ignore_eos=True))
    b = ("b", [5, 6, 7, 8], dict(max_tokens=40, temperature=0.0, ignore_eos=True))
    kw = dict(block_size=4, num_gpu_blocks=6, num_cpu_blocks=64, preemption_mode="swap")
    alone, _, _, _ = _run(tiny_llama_dir, None, kw, [a])
    both, _, _, (_, swaps) = _run(tiny_llama_dir, None, kw, [b, a])
    assert swaps >= 1
    assert [len(t) for t, _ in alone["a"][1]] == [13, 13, 13]
    assert both["a"] == alone["a"]
