"""Speculative decoding for constrained (structured-output) requests, on the tiny random Llama.

Drafts are checked against the sequence's grammar and every verified position is masked with
the matcher state after the drafts before it, so: greedy constrained output with speculation
equals speculation off token for token (n-gram drafts, always-right drafts, always-wrong
drafts) under chunked prefill, prefix caching, preemption by recompute and by swap, and n > 1;
every output validates; a draft the grammar forbids is never accepted; blocks are conserved
after every step and every matcher is freed at the end."""

import json
import random
import re
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import SamplingParams, StructuredOutputsParams
from kvserve.spec_decode.interfaces import Proposal, Proposer
from tests.spec_decode.test_spec_decode_engine import drain, make_engine
from tests.spec_decode.test_spec_decode_engine import ngram as _ngram


def ngram(**kw):
    # fixed k: these tests check how drafts meet a grammar, so every step must draft; the
    # dynamic policy, timed on a loaded machine, may give the constrained requests none
    # (its greedy equality with speculation off is tested in test_spec_decode_engine)
    return _ngram(**{"dynamic": False, **kw})


K = 4
MAX_TOKENS = 64
SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"enum": ["x", "yy", "zzz"]},
        "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}
AB = r"(ab){1,8}c?"
IDS = r"id=[0-9]{1,3}(;id=[0-9]{1,3}){0,3}"
#: name -> (StructuredOutputsParams kwargs, check of the finished text)
CONSTRAINTS = {
    "ab": (dict(regex=AB), lambda t: re.fullmatch(AB, t)),
    "ids": (
        dict(grammar='root ::= "id=" [0-9]{1,3} (";id=" [0-9]{1,3}){0,3}'),
        lambda t: re.fullmatch(IDS, t),
    ),
    "choice": (
        dict(choice=["yes yes yes", "no", "maybe maybe"]),
        lambda t: t in ("yes yes yes", "no", "maybe maybe"),
    ),
    "json": (
        dict(json=SCHEMA, disable_any_whitespace=True),
        lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True,
    ),
}
#: Distinct repetitive prompts (the n-gram proposer finds matches in them and in the output).
PROMPTS = {
    "ab": [100, 200] * 5,
    "ids": [11, 12, 13, 14, 15] * 3,
    "choice": [42] * 3 + [43] * 3 + [42] * 3,
    "json": [3000, 4000, 5000] * 4 + [6000],
}
FREE = {"free": [7] * 10, "free2": [900, 901, 902, 903] * 2}  # unconstrained neighbours


def so(name):
    return StructuredOutputsParams(**CONSTRAINTS[name][0])


def params(name, n=1, temperature=0.0, seed=None):
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=temperature, n=n, seed=seed, structured_outputs=so(name)
    )


def requests(n=1):
    # The unconstrained neighbours first: under a tiny cache the later (constrained) arrivals
    # are the ones preempted.
    reqs = [
        (rid, p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for rid, p in FREE.items()
    ]
    reqs += [(name, PROMPTS[name], params(name, n=n)) for name in CONSTRAINTS]
    return reqs


def check_valid(finals):
    """Every request finished; every constrained output is complete (``stop``) and validates."""
    for rid, out in finals.items():
        assert out.outcome == "finished", (rid, out.error)
        if rid in CONSTRAINTS:
            for c in out.outputs:
                assert c.finish_reason == "stop", (rid, c.text, c.finish_reason)
                assert CONSTRAINTS[rid][1](c.text), (rid, c.text)


def check_against(finals, reference):
    check_valid(finals)
    for rid, out in finals.items():
        assert [c.token_ids for c in out.outputs] == reference[rid], rid


def check_freed(eng):
    assert eng.structured_output.num_live == 0, "a matcher outlived its sequence"


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Speculation off, roomy cache: request id -> [token ids per sample] (n = 1 and n = 2)."""
    out = {}
    for n in (1, 2):
        eng = make_engine(tiny_llama_dir, block_size=4, num_gpu_blocks=256)
        finals, _ = drain(eng, requests(n))
        check_valid(finals)
        out[n] = {rid: [c.token_ids for c in o.outputs] for rid, o in finals.items()}
    return out


class Oracle(Proposer):
    """Proposes the reference continuation; ``wrong`` shifts every draft by one token id (never
    the target's choice); ``poison`` replaces the draft at that index with a token the grammar
    forbids there. Records the accepted counts it is told of."""

    def __init__(self, eng, reference, wrong=False, poison=None, rng=None, overrun=False):
        self.eng = eng
        self.overrun = overrun  # propose past the end of the reference (its start again)
        self.overran = 0
        self.rng = rng  # random.Random: each draft replaced by a random id with probability 0.3
        self.conts = {tuple({**PROMPTS, **FREE}[rid]): (rid, toks[0]) for rid, toks in reference.items()}
        self.wrong, self.poison = wrong, poison
        self.accepted: list[int] = []
        self.poisoned = 0

    def propose(self, req, k):
        vocab = self.eng.executor.vocab_size
        out = {}
        for md in req.seq_group_metadata_list:
            m = min(k, md.num_speculative_tokens)
            if md.is_prompt or m < 1:
                continue
            for sid, data in md.seq_data.items():
                rid, ref = self.conts[tuple(data.prompt_token_ids)]
                n = data.get_output_len()
                assert data.output_token_ids == ref[:n], "the sequence left the reference"
                drafts = list((ref + ref if self.overrun else ref)[n : n + m])
                self.overran += self.overrun and n + m > len(ref)
                if not drafts:
                    continue
                if self.wrong:
                    drafts = [(t + 1) % vocab for t in drafts]
                elif self.rng is not None:
                    drafts = [self.rng.randrange(vocab) if self.rng.random() < 0.3 else t for t in drafts]
                elif self.poison is not None and rid in CONSTRAINTS and len(drafts) > self.poison:
                    drafts[self.poison] = self._forbidden(rid, data.output_token_ids + drafts[: self.poison])
                    self.poisoned += 1
                out[sid] = Proposal(drafts)
        return out

    def _forbidden(self, rid, prefix):
        # A matcher of our own (the sequence's may be in use by the grammar thread now).
        m = self.eng.structured_output.compiler.new_matcher(so(rid))
        assert m.consume_tokens(prefix)
        return next(t for t in range(1000) if m.validate_tokens([t]) == 0)

    def on_verified(self, accepted):
        self.accepted.extend(accepted.values())


MODES = {
    "plain": dict(num_gpu_blocks=256),
    # 16 blocks of 4 tokens: one unconstrained neighbour (and its lookahead) fits, not two
    "recompute": dict(num_gpu_blocks=16, preemption_mode="recompute"),
    "swap": dict(num_gpu_blocks=16, num_cpu_blocks=128, preemption_mode="swap"),
    "prefix_chunked": dict(
        num_gpu_blocks=256, enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16
    ),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_constrained_ngram_speculation_equals_off(tiny_llama_dir, reference, mode):
    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, **MODES[mode])

    def later(step):
        if step == 8:  # the same prompt again once its blocks are computed: prefix-cache hits
            eng.add_request("ab again", {"prompt_token_ids": PROMPTS["ab"]}, params("ab"))

    finals, _ = drain(eng, requests(), on_step=later)
    again = finals.pop("ab again")
    check_against(finals, reference[1])
    check_against({"ab": again}, reference[1])
    check_freed(eng)
    assert sum(finals[r].spec_num_draft_tokens for r in CONSTRAINTS) > 0, (
        "constrained requests must speculate"
    )
    if mode in ("recompute", "swap"):
        assert eng.get_kv_cache_stats()["num_preemptions"] > 0, "the tiny cache must force preemption"
    if mode == "prefix_chunked":
        assert eng.get_kv_cache_stats()["prefix_cache_hits"] > 0


@pytest.mark.parametrize("mode", ["plain", "recompute", "swap", "prefix_chunked"])
def test_oracle_drafts_are_all_accepted_under_the_grammar(tiny_llama_dir, reference, mode):
    """Always-right drafts: every one is accepted (each position saw its own mask: a wrong mask
    would change the target's choice there), the output is unchanged."""
    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, **MODES[mode])
    eng.executor.proposer = Oracle(eng, reference[1])
    finals, _ = drain(eng, requests())
    check_against(finals, reference[1])
    check_freed(eng)
    for rid in CONSTRAINTS:
        assert finals[rid].spec_num_accepted_tokens == finals[rid].spec_num_draft_tokens, rid
    assert sum(finals[r].spec_num_accepted_tokens for r in CONSTRAINTS) > 0


def test_always_wrong_drafts_change_nothing(tiny_llama_dir, reference):
    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=256)
    eng.executor.proposer = oracle = Oracle(eng, reference[1], wrong=True)
    finals, _ = drain(eng, requests())
    check_against(finals, reference[1])
    check_freed(eng)
    assert sum(finals[r].spec_num_draft_tokens for r in CONSTRAINTS) > 0
    assert eng.stats.spec_num_accepted_tokens == 0 and set(oracle.accepted) == {0}


@pytest.mark.parametrize("poison", [0, 1])
def test_a_draft_the_grammar_forbids_is_never_accepted(tiny_llama_dir, reference, poison):
    """Right drafts with one the grammar forbids at index ``poison``: the ones before it are
    accepted, it and everything after it never are (the target's correction takes its place)."""
    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=256)
    eng.executor.proposer = oracle = Oracle(eng, reference[1], poison=poison)
    finals, _ = drain(eng, requests())
    check_against(finals, reference[1])
    check_freed(eng)
    assert oracle.poisoned > 0
    for rid in CONSTRAINTS:
        assert finals[rid].spec_num_accepted_tokens <= poison * finals[rid].spec_num_draft_tokens
    if poison:
        assert sum(finals[r].spec_num_accepted_tokens for r in CONSTRAINTS) > 0
    else:
        assert sum(finals[r].spec_num_accepted_tokens for r in CONSTRAINTS) == 0


def test_a_grammar_completed_inside_an_accepted_run_ends_the_output_there(tiny_llama_dir, reference):
    """Right drafts that run on past the end of the output (the output again): the run is cut
    where the grammar completes and nothing after it is emitted."""
    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=256)
    eng.executor.proposer = oracle = Oracle(eng, reference[1], overrun=True)
    finals, _ = drain(eng, requests())
    check_against(finals, reference[1])
    check_freed(eng)
    assert oracle.overran > 0
    assert sum(finals[r].spec_num_accepted_tokens for r in CONSTRAINTS) > 0


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(list(MODES)))
def test_any_drafts_leave_constrained_greedy_output_unchanged(tiny_llama_dir, reference, seed, mode):
    """Property: reference drafts with random ids mixed in (most of them forbidden by the
    grammar, some allowed but wrong) never change greedy constrained output, in any mode."""
    eng = make_engine(tiny_llama_dir, ngram(), block_size=4, **MODES[mode])
    eng.executor.proposer = Oracle(eng, reference[1], rng=random.Random(seed))
    finals, _ = drain(eng, requests())
    check_against(finals, reference[1])
    check_freed(eng)


def test_n_greater_than_one_greedy_equals_off(tiny_llama_dir, reference):
    for proposer in ("ngram", "oracle"):
        eng = make_engine(
            tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=64, preemption_mode="recompute"
        )
        if proposer == "oracle":
            eng.executor.proposer = Oracle(eng, reference[2])
        finals, _ = drain(eng, requests(n=2))
        check_against(finals, reference[2])
        check_freed(eng)
        if proposer == "oracle":
            assert sum(finals[r].spec_num_accepted_tokens for r in CONSTRAINTS) > 0


def test_sampled_constrained_output_with_speculation_validates(tiny_llama_dir, reference):
    """Random rows go through rejection sampling against the masked target: every output
    validates (n = 2, seeded), with n-gram and with reference drafts."""
    for proposer in ("ngram", "oracle"):
        eng = make_engine(tiny_llama_dir, ngram(), block_size=4, num_gpu_blocks=256)
        if proposer == "oracle":
            eng.executor.proposer = Oracle(eng, reference[1])
        reqs = [(name, PROMPTS[name], params(name, n=2, temperature=0.8, seed=5)) for name in CONSTRAINTS]
        finals, _ = drain(eng, reqs)
        check_valid(finals)
        check_freed(eng)
        assert sum(finals[r].spec_num_draft_tokens for r in CONSTRAINTS) > 0


# ------------------------------------------------------------------------------ the masks
@pytest.fixture(scope="module")
def manager(default_tokenizer_dir):
    from transformers import AutoTokenizer

    from kvserve.structured_output import GrammarCompiler, StructuredOutputManager

    tok = AutoTokenizer.from_pretrained(default_tokenizer_dir)
    return tok, StructuredOutputManager(GrammarCompiler(tok, len(tok), tok.eos_token_id))


def _mask_after(manager, params, tokens):
    from llguidance.torch import fill_next_token_bitmask

    from kvserve.structured_output import bitmask_words

    m = manager.compiler.new_matcher(params)
    assert m.consume_tokens(tokens)
    out = torch.zeros(1, bitmask_words(manager.compiler.vocab_size), dtype=torch.int32)
    fill_next_token_bitmask(m, out, 0)
    return out[0]


def test_verify_masks_are_the_matcher_states_after_each_draft(manager):
    """Rows ``0 .. allowed`` equal the masks of fresh matchers fed ``drafts[:i]``; drafts are cut
    at the first forbidden one and after the one that completes the grammar; the sequences'
    matchers are left as they were."""
    tok, mgr = manager
    p = StructuredOutputsParams(regex="(ab){1,3}")
    (ab,) = tok.encode("ab", add_special_tokens=False)
    (x,) = tok.encode("x", add_special_tokens=False)
    drafts = [[ab, ab, x, ab], [ab, ab, ab, ab], [x], []]
    sids = [101, 102, 103, 104]
    for sid in sids:
        mgr.add_sequence(sid, p)
    md = SimpleNamespace(
        do_sample=True, seq_data={sid: None for sid in sids}, request_id="r", token_bitmask=None
    )
    step = mgr.prepare_step([md])
    vm = md.token_bitmask.verify_masks(drafts)
    step.wait()
    assert [vm.get(j)[0] for j in range(4)] == [2, 3, 0, 0]
    for j, d in enumerate(drafts):
        allowed, rows = vm.get(j)
        assert rows.shape[0] == allowed + 1
        for i in range(allowed + 1):
            assert torch.equal(rows[i], _mask_after(mgr, p, d[:i])), (j, i)
    # the matchers are where they were: "ab" x 3 is still allowed and completes the grammar
    for sid in sids:
        assert not mgr.accept_token(sid, ab) and not mgr.accept_token(sid, ab) and mgr.accept_token(sid, ab)
        mgr.free(sid)
    with pytest.raises(ValueError, match="draft lists"):
        mgr.add_sequence(1, p)
        md2 = SimpleNamespace(do_sample=True, seq_data={1: None}, request_id="r2", token_bitmask=None)
        mgr.prepare_step([md2])
        md2.token_bitmask.verify_masks([[ab], [ab]])
    mgr.free(1)
    assert mgr.num_live == 0


def test_a_grammar_fault_in_a_verify_step_fails_only_that_request(tiny_llama_dir, reference, monkeypatch):
    """A matcher fault while verifying one request's drafts ends that request ``failed`` (its
    blocks and matcher freed); the others' output is unchanged."""
    from kvserve.structured_output import GrammarError, VerifyMasks

    real_get = VerifyMasks.get

    def get(self, j):
        if self.request_id == "json":
            raise GrammarError("request json: injected matcher fault")
        return real_get(self, j)

    monkeypatch.setattr(VerifyMasks, "get", get)
    # fixed k: the dynamic policy, timed on a loaded machine, may give "json" no drafts at all
    # (then no verify step, no fault, and it finished)
    eng = make_engine(tiny_llama_dir, ngram(dynamic=False), block_size=4, num_gpu_blocks=256)
    eng.executor.proposer = Oracle(eng, reference[1])
    finals, _ = drain(eng, requests())
    bad = finals.pop("json")
    assert bad.outcome == "failed" and "injected matcher fault" in bad.error
    check_against(finals, reference[1])
    check_freed(eng)
