"""DraftModelProposer alone, driven by hand-made steps (no scheduler): its greedy proposals
equal the draft model's own greedy continuation computed by transformers (full recompute, no
cache), after every kind of step that can leave its K/V stale: partial acceptance, a fully
accepted run (the draft lags a token), chunked prefill, a prefix-cache hit on blocks it never
computed, recompute preemption onto blocks another sequence overwrote, and swap out / in."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import SpeculativeConfig
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata
from kvserve.spec_decode.draft_model_proposer import DraftModelProposer
from tests.model_executor.helpers import ToyAllocator, llama_config, make_worker

BS = 4
K = 3
VOCAB = 256


def _save(path, seed: int, vocab: int = VOCAB, layers: int = 2):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        llama_config(vocab_size=vocab, num_hidden_layers=layers), dtype=torch.float32
    )
    with torch.no_grad():  # decisive greedy choices (few near-ties) on random weights
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target_dir = tmp_path_factory.mktemp("target")
    draft_dir = tmp_path_factory.mktemp("draft")
    _save(target_dir, 0)
    draft_hf = _save(draft_dir, 1, layers=1)
    return target_dir, draft_dir, draft_hf


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


class Driver:
    """Plays the engine for one proposer: block tables, computed counts, verification."""

    def __init__(self, proposer: DraftModelProposer, num_blocks: int = 64):
        self.p = proposer
        self.alloc = ToyAllocator(num_blocks, seed=3)
        self.tables: dict[int, list[int]] = {}
        self.data: dict[int, SequenceData] = {}
        self.params = SamplingParams(temperature=0.0, max_tokens=1000)

    def add(self, sid: int, prompt: list[int]) -> None:
        self.data[sid] = SequenceData(prompt)
        self.tables[sid] = []

    def md(self, sid: int, is_prompt: bool, chunk: int, spec: int = 0) -> SequenceGroupMetadata:
        d = self.data[sid]
        self.alloc.grow(self.tables[sid], d.get_num_computed_tokens() + chunk + spec, BS)
        return SequenceGroupMetadata(
            f"r{sid}",
            is_prompt,
            {sid: d},
            self.params,
            {sid: list(self.tables[sid])},
            token_chunk_size=chunk,
            num_speculative_tokens=spec,
        )

    def step(self, mds, **moves) -> dict:
        req = ExecuteModelRequest(mds, **moves)
        self.p.apply_block_moves(req)
        return self.p.propose(req, K)

    def prefill(self, sid: int, chunk: int, first_token: int | None = None) -> None:
        assert self.step([self.md(sid, True, chunk)]) == {}
        d = self.data[sid]
        d.update_num_computed_tokens(chunk)
        if d.get_num_uncomputed_tokens() == 0:
            d.append_token_id(first_token if first_token is not None else 7)

    def decode(self, sid: int, accept: int, **moves) -> list[int]:
        """A speculative decode: propose, then accept ``accept`` drafts and append a correction
        (a token other than the next draft) or the bonus. Returns the drafts."""
        d = self.data[sid]
        length = d.get_len()
        drafts = self.step([self.md(sid, False, 1, spec=K)], **moves)[sid].token_ids
        assert len(drafts) == K
        emitted = drafts[:accept] + [(drafts[accept] + 1) % VOCAB if accept < K else 11]
        for t in emitted:
            d.append_token_id(t)
        d.set_num_computed_tokens(length + accept)  # the engine's rollback
        self.p.on_verified({sid: accept})
        return drafts


@pytest.fixture
def driver(models):
    target_dir, draft_dir, _ = models
    worker = make_worker(target_dir, block_size=BS, num_gpu_blocks=64, num_cpu_blocks=16)
    spec = SpeculativeConfig(method="draft_model", model=str(draft_dir), num_speculative_tokens=K)
    return Driver(DraftModelProposer(spec, worker))


def check(driver: Driver, draft_hf, sid: int, accept: int, **moves) -> None:
    d = driver.data[sid]
    expect = hf_greedy(draft_hf, d.get_token_ids(), K)
    assert driver.decode(sid, accept, **moves) == expect


def test_greedy_proposals_equal_the_draft_models_own_continuation(driver, models):
    draft_hf = models[2]
    driver.add(0, [5, 9, 17, 33, 65, 129, 3, 4, 8])
    driver.prefill(0, 9)
    # partial, none, all (the draft lags one token), all again, partial
    for accept in [1, 0, K, K, 2, 0, K, 1]:
        check(driver, draft_hf, 0, accept)


def test_catch_up_feeds_only_what_is_missing(driver, models):
    driver.add(0, list(range(10, 22)))
    driver.prefill(0, 12)
    fed = driver.p.num_fed_tokens
    assert fed == 12
    driver.decode(0, accept=K)  # feeds 1 + (K - 1) drafts
    assert driver.p.num_fed_tokens - fed == K
    fed = driver.p.num_fed_tokens
    driver.decode(0, accept=0)  # lagging by one after a full run: feeds 2 + (K - 1)
    assert driver.p.num_fed_tokens - fed == 2 + K - 1


def test_chunked_prefill(driver, models):
    draft_hf = models[2]
    driver.add(0, list(range(40, 57)))
    for chunk in (5, 8, 4):
        driver.prefill(0, chunk)
    for accept in [K, 1, 0]:
        check(driver, draft_hf, 0, accept)


def test_prefix_hit_on_blocks_the_draft_never_computed(driver, models):
    # Sequence 1 starts with 8 tokens "computed" (a prefix-cache hit) in blocks the draft
    # never wrote for it: the proposer must feed them itself.
    draft_hf = models[2]
    driver.add(1, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])
    driver.data[1].set_num_computed_tokens(8)
    driver.prefill(1, 3)
    check(driver, draft_hf, 1, 2)
    assert driver.p.num_fed_tokens == 11 + 1 + K - 1  # prompt, first output, drafts fed back


def test_prefix_hit_on_blocks_another_sequence_computed(driver, models):
    draft_hf = models[2]
    prompt = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]
    driver.add(0, prompt)
    driver.prefill(0, 10)
    # Sequence 2 shares sequence 0's first two blocks (cache hit) but the proposer has no record
    # of them for sequence 2: it may not trust them, it recomputes.
    driver.add(2, prompt[:8] + [99, 98])
    driver.tables[2] = driver.tables[0][:2]
    driver.data[2].set_num_computed_tokens(8)
    driver.prefill(2, 2)
    check(driver, draft_hf, 2, 1)
    check(driver, draft_hf, 0, 1)


def _recompute_with_8_cached(driver, draft_hf, hit_blocks):
    """Sequence 0 is recomputed and finds its first 8 tokens cached in ``hit_blocks``, whose
    draft K/V are junk (another sequence's); it must still draft as the draft model would."""
    driver.p.cache_engine.device_cache[:, :, :, hit_blocks] = 0.5
    d = driver.data[0]
    d.reset_state_for_recompute()
    driver.tables[0] = list(hit_blocks)
    d.set_num_computed_tokens(8)
    driver.prefill(0, d.get_len() - 8)
    for accept in [1, K]:
        check(driver, draft_hf, 0, accept)


def test_recompute_onto_overwritten_blocks(driver, models):
    draft_hf = models[2]
    driver.add(0, list(range(60, 70)))
    driver.prefill(0, 10)
    check(driver, draft_hf, 0, K)
    # Preempt by recompute: blocks freed and handed to sequence 3, which overwrites them.
    freed = driver.tables[0]
    driver.tables[0] = []
    driver.alloc.free.extend(reversed(freed))
    driver.add(3, list(range(100, 100 + 4 * len(freed))))
    driver.prefill(3, 4 * len(freed))
    driver.p.free([3])
    driver.tables[3] = []
    driver.alloc.free.extend(reversed(freed))  # and get them back, in the same order
    d = driver.data[0]
    d.reset_state_for_recompute()
    driver.prefill(0, d.get_len())  # re-prefill of prompt + outputs (appends one token)
    assert driver.tables[0][: len(freed)] == freed  # the same block numbers: stale unless refed
    for accept in [0, K, 1]:
        check(driver, draft_hf, 0, accept)


def test_swap_out_and_in_keeps_draft_kv(driver, models):
    draft_hf = models[2]
    driver.add(0, list(range(80, 91)))
    driver.prefill(0, 11)
    check(driver, draft_hf, 0, 1)
    table = driver.tables[0]
    cpu = {b: i for i, b in enumerate(table)}
    driver.step([], blocks_to_swap_out=cpu)  # swapped out (a step without this sequence)
    driver.p.cache_engine.device_cache[:, :, :, table] = 0.0  # its device blocks get reused
    new = [driver.alloc.free.pop() for _ in table]
    driver.tables[0] = new
    fed = driver.p.num_fed_tokens
    check(driver, draft_hf, 0, 2, blocks_to_swap_in={i: b for i, b in enumerate(new)})
    assert driver.p.num_fed_tokens - fed == 1 + K - 1  # nothing recomputed after the swap-in


def test_copy_on_write_keeps_draft_kv(driver, models):
    draft_hf = models[2]
    driver.add(0, list(range(30, 39)))
    driver.prefill(0, 9)
    check(driver, draft_hf, 0, 0)
    last = len(driver.tables[0]) - 1
    src = driver.tables[0][last]
    dst = driver.alloc.free.pop()
    driver.tables[0][last] = dst
    fed = driver.p.num_fed_tokens
    check(driver, draft_hf, 0, 1, blocks_to_copy={src: [dst]})
    assert driver.p.num_fed_tokens - fed == 1 + K - 1


def test_sampled_drafts_come_with_their_distribution_and_follow_the_seed(driver):
    driver.params = SamplingParams(temperature=0.9, top_k=50, seed=5, max_tokens=1000)
    driver.add(0, [4, 8, 15, 16, 23, 42])
    driver.prefill(0, 6)

    def propose(seed: int):
        md = driver.md(0, False, 1, spec=K)
        md.generator = torch.Generator().manual_seed(seed)
        req = ExecuteModelRequest([md])
        driver.p.apply_block_moves(req)
        return driver.p.propose(req, K)[0]

    a, b = propose(1), propose(1)
    assert a.token_ids == b.token_ids and torch.equal(a.probs, b.probs)
    assert a.probs.shape == (K, VOCAB)
    assert torch.allclose(a.probs.sum(-1), torch.ones(K), atol=1e-5)
    assert int((a.probs > 0).sum(-1).max()) <= 50  # top-k applied
    for j, t in enumerate(a.token_ids):
        assert a.probs[j, t] > 0  # each draft was drawn from its row
    assert any(propose(s).token_ids != a.token_ids for s in range(2, 12))


def test_max_tokens_limits_the_drafts(driver):
    driver.params = SamplingParams(temperature=0.0, max_tokens=3)
    driver.add(0, [1, 2, 3, 4, 5])
    driver.prefill(0, 5)  # one output token; room for 2 more, so at most 1 draft
    props = driver.step([driver.md(0, False, 1, spec=K)])
    assert len(props[0].token_ids) == 1


def test_vocab_mismatch_names_the_field(models, tmp_path):
    target_dir = models[0]
    _save(tmp_path, 2, vocab=VOCAB + 1)
    worker = make_worker(target_dir, block_size=BS, num_gpu_blocks=8, num_cpu_blocks=0)
    spec = SpeculativeConfig(method="draft_model", model=str(tmp_path), num_speculative_tokens=K)
    with pytest.raises(ValueError, match=r"speculative_config\.model.*257.*256"):
        DraftModelProposer(spec, worker)


def test_missing_dir_names_the_field(models, tmp_path):
    worker = make_worker(models[0], block_size=BS, num_gpu_blocks=8, num_cpu_blocks=0)
    spec = SpeculativeConfig(method="draft_model", model=str(tmp_path / "nope"), num_speculative_tokens=K)
    with pytest.raises(ValueError, match=r"speculative_config\.model.*does not exist"):
        DraftModelProposer(spec, worker)


def test_recompute_with_prefix_hit_on_other_blocks(driver, models):
    # After a recompute preemption the target finds the first 8 tokens in cached blocks that
    # are not the ones the draft wrote them to: the draft's K/V there is not this sequence's.
    draft_hf = models[2]
    driver.add(0, list(range(120, 131)))
    driver.prefill(0, 11)
    check(driver, draft_hf, 0, K)
    other = [driver.alloc.free.pop() for _ in range(2)]
    _recompute_with_8_cached(driver, draft_hf, other)


def test_recompute_with_prefix_hit_on_its_old_block_numbers_overwritten_meanwhile(driver, models):
    # After a recompute preemption the target finds the first 8 tokens cached in blocks with
    # the sequence's *old* numbers; meanwhile they were evicted, written by another sequence's
    # draft, and recomputed for these tokens on the target alone (by a request the draft never
    # saw, e.g. one that ended with its prefill). The numbers match, the draft K/V are not its.
    draft_hf = models[2]
    driver.add(0, list(range(140, 151)))
    driver.prefill(0, 11)
    check(driver, draft_hf, 0, K)
    _recompute_with_8_cached(driver, draft_hf, driver.tables[0][:2])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fuzz_random_events_never_leave_stale_kv(driver, models, seed):
    """Random acceptances, plain decodes (the draft is not fed), recompute preemptions (with
    the blocks overwritten meanwhile, and sometimes a prefix hit on the first blocks) and swap
    round trips, in any order: every greedy proposal equals the draft model's own continuation."""
    import random

    rng = random.Random(seed)
    draft_hf = models[2]
    driver.add(0, [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 12))])
    d = driver.data[0]
    driver.prefill(0, d.get_len())
    hits = 0
    for _ in range(14):
        event = rng.choice(["spec", "spec", "spec", "plain", "recompute", "swap"])
        if event == "spec":
            check(driver, draft_hf, 0, rng.randrange(0, K + 1))
        elif event == "plain":  # a step without speculation: the target decodes alone
            driver.step([driver.md(0, False, 1)])
            d.update_num_computed_tokens(1)
            d.append_token_id(rng.randrange(3, VOCAB))
        elif event == "recompute":
            old = driver.tables[0]
            # A prefix-cache hit keeps the first full blocks (cached: nobody writes them); the
            # rest are freed and written by others meanwhile.
            full = (d.get_len() - 1) // BS  # full blocks before the last token
            keep = rng.randrange(1, full + 1) if full and rng.random() < 0.5 else 0
            hits += keep > 0
            driver.p.cache_engine.device_cache[:, :, :, old[keep:]] = rng.random()
            driver.alloc.free.extend(old[keep:])
            driver.tables[0] = old[:keep]
            d.reset_state_for_recompute()
            d.set_num_computed_tokens(keep * BS)
            end = d.get_len()  # chunked re-prefill of prompt + outputs (samples a token at the end)
            while d.get_num_computed_tokens() < end:
                driver.prefill(0, min(rng.randrange(1, 9), end - d.get_num_computed_tokens()))
        else:
            table = driver.tables[0]
            driver.step([], blocks_to_swap_out={b: i for i, b in enumerate(table)})
            driver.p.cache_engine.device_cache[:, :, :, table] = rng.random()
            driver.alloc.free.extend(table)
            new = [driver.alloc.free.pop(0) for _ in table]
            driver.tables[0] = new
            driver.step([], blocks_to_swap_in={i: b for i, b in enumerate(new)})
    assert d.get_len() < 250
    print(f"seed {seed}: {hits} prefix hits after recompute")


def test_catch_up_is_spread_over_steps(driver, models):
    """A sequence far behind (here: 32 tokens the draft never saw, a prefix-cache hit) is fed
    at most ``max_catch_up_tokens`` per step and proposes once it has caught up."""
    draft_hf = models[2]
    driver.p.max_catch_up_tokens = 12
    driver.add(0, [(7 * j) % 200 + 3 for j in range(33)])
    driver.data[0].set_num_computed_tokens(32)  # hit on 8 blocks
    driver.prefill(0, 1)  # fed positions 0..11 of 0..32
    assert driver.p.num_fed_tokens == 12
    # length 34: 22 missing > 12: fed 12..23, no proposal
    assert driver.step([driver.md(0, False, 1, spec=K)]) == {}
    assert driver.p.num_fed_tokens == 24
    driver.data[0].update_num_computed_tokens(1)
    driver.data[0].append_token_id(9)
    check(driver, draft_hf, 0, 1)  # length 35: 11 missing: fed, then proposes
    assert driver.p.num_fed_tokens == 24 + 11 + K - 1


def test_failed_block_moves_drop_all_draft_state(driver, models, monkeypatch):
    """A swap that fails half way leaves the draft cache unknown: the proposer forgets what it
    computed (and re-feeds) instead of reading it."""
    draft_hf = models[2]
    driver.add(0, list(range(50, 61)))
    driver.prefill(0, 11)
    check(driver, draft_hf, 0, 1)
    cache = driver.p.cache_engine

    def broken(mapping):
        cache.device_cache.fill_(0.25)  # half applied: garbage everywhere
        raise RuntimeError("swap failed")

    monkeypatch.setattr(cache, "swap_in", broken)
    with pytest.raises(RuntimeError, match="swap failed"):
        driver.step([], blocks_to_swap_in={0: driver.alloc.free[-1]})
    monkeypatch.undo()
    fed = driver.p.num_fed_tokens
    check(driver, draft_hf, 0, 2)
    assert driver.p.num_fed_tokens - fed == driver.data[0].get_len() - 3 + K - 1  # everything re-fed
