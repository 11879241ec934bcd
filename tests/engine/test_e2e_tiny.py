"""End-to-end on a tiny random-weight Llama: greedy equals transformers under every kind of
scheduling pressure; blocks are conserved; every request ends and says how."""

import random

import pytest

from kvserve import LLM, SamplingParams
from tests.golden import TEST_DEVICE, compare, hf_greedy

PROMPT_LENS = [3, 17, 33, 50, 8, 21]
MAX_NEW = 20
#: Where and how the engine runs: as the transformers reference (float32, TEST_DEVICE).
ENGINE = dict(device=TEST_DEVICE, dtype="float32")


@pytest.fixture(scope="module")
def prompts():
    """Prompts of several lengths; the last two share a 24-token prefix with the 33-token one
    (so prefix caching has full blocks to reuse)."""
    rng = random.Random(0)
    ps = [[rng.randrange(3, 49152) for _ in range(n)] for n in PROMPT_LENS]
    shared = ps[2][:24]
    ps += [shared + [rng.randrange(3, 49152) for _ in range(n)] for n in (5, 13)]
    return ps


@pytest.fixture(scope="module")
def references(tiny_hf_model, prompts):
    return [hf_greedy(tiny_hf_model, p, MAX_NEW) for p in prompts]


def run_engine(engine, requests, check_every_step=True, max_steps=5000, on_step=None):
    """Add ``(request_id, prompt_ids, params)`` and step to the end; returns final outputs by id.
    Checks block accounting after every step, then calls ``on_step(step_index)`` if given."""
    for rid, ids, params in requests:
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    finals = {}
    for step in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, "a request finished twice"
                finals[out.request_id] = out
        if check_every_step:
            st = engine.get_kv_cache_stats()
            assert 0 <= st["num_free_gpu_blocks"] <= st["num_gpu_blocks"]
            assert 0 <= st["num_free_cpu_blocks"] <= st["num_cpu_blocks"]
        if on_step is not None:
            on_step(step)
    else:
        raise AssertionError("engine did not drain")
    assert_idle(engine)
    return finals


def assert_idle(engine):
    st = engine.get_kv_cache_stats()
    assert st["num_free_gpu_blocks"] == st["num_gpu_blocks"], st
    assert st["num_free_cpu_blocks"] == st["num_cpu_blocks"], st
    s = engine.scheduler
    assert not s.waiting and not s.running and not s.swapped
    assert not engine._groups and not engine._max_tokens
    assert not getattr(engine, "_live_loras", None)  # no adapter id held by a request


def greedy(max_tokens=MAX_NEW, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def check_all(finals, references, n=1):
    near_ties = 0
    for i, ref in enumerate(references):
        out = finals[f"r{i}"]
        assert out.outcome == "finished"
        assert len(out.outputs) == n
        for c in out.outputs:
            near_ties += compare(c.token_ids, ref)
    return near_ties


CONFIGS = {
    "default": dict(),
    "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
    "prefix": dict(enable_prefix_caching=True),
    "recompute_tiny_cache": dict(
        block_size=4, num_gpu_blocks=24, num_cpu_blocks=64, preemption_mode="recompute"
    ),
    "swap_tiny_cache": dict(block_size=4, num_gpu_blocks=24, num_cpu_blocks=64, preemption_mode="swap"),
    "chunked_prefix_recompute": dict(
        block_size=4,
        num_gpu_blocks=24,
        num_cpu_blocks=64,
        preemption_mode="recompute",
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=16,
    ),
    "chunked_swap": dict(
        block_size=4,
        num_gpu_blocks=24,
        num_cpu_blocks=64,
        preemption_mode="swap",
        enable_chunked_prefill=True,
        max_num_batched_tokens=24,
    ),
}


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_answer_never_depends_on_scheduling(tiny_llama_dir, prompts, references, chunked, prefix, mode):
    """Chunked prefill x prefix caching x preemption mode, with a cache small enough to force
    preemption: greedy output equals transformers every time."""
    llm = LLM(
        model=str(tiny_llama_dir),
        **ENGINE,
        block_size=4,
        num_gpu_blocks=28,
        num_cpu_blocks=64,
        preemption_mode=mode,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=prefix,
        max_num_batched_tokens=24 if chunked else None,
    )
    engine = llm.llm_engine
    finals = run_engine(engine, [(f"r{i}", p, greedy()) for i, p in enumerate(prompts)])
    near_ties = check_all(finals, references)
    print(f"[chunked={chunked} prefix={prefix} {mode}] near-ties: {near_ties} of {len(prompts)}")
    stats = engine.get_kv_cache_stats()
    assert stats["num_preemptions"] > 0, "the tiny cache must force preemption"
    if prefix:
        assert stats["prefix_cache_hits"] > 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_transformers(tiny_llama_dir, prompts, references, name):
    llm = LLM(model=str(tiny_llama_dir), **ENGINE, seed=0, **CONFIGS[name])
    engine = llm.llm_engine
    finals = run_engine(engine, [(f"r{i}", p, greedy()) for i, p in enumerate(prompts)])
    near_ties = check_all(finals, references)
    print(f"[{name}] near-ties: {near_ties} of {len(prompts)} requests")
    if "tiny_cache" in name or "recompute" in name or "swap" in name:
        assert engine.get_kv_cache_stats()["num_preemptions"] > 0, "the tiny cache must force preemption"


def test_warm_up_step_runs_a_real_prefill_and_leaves_no_trace(tiny_llama_dir, prompts, monkeypatch):
    """The engine's start-up warm-up (one throw-away prefill of max_num_batched_tokens tokens,
    bfloat16 here: float32 on CPU skips it) writes K/V into blocks nobody holds; the block
    manager never learns of them, and what follows (prefix caching on, blocks reused) is
    token for token what an engine without the warm-up gives."""
    from kvserve.worker.worker import Worker

    kw = dict(
        device=TEST_DEVICE,
        dtype="bfloat16",
        block_size=4,
        num_gpu_blocks=64,
        max_num_batched_tokens=48,
        enable_prefix_caching=True,
    )
    requests = [(f"r{i}", p, greedy()) for i, p in enumerate(prompts)]
    engine = LLM(model=str(tiny_llama_dir), **kw).llm_engine
    worker = engine.executor
    cache = worker.cache_engine.gpu_cache[0]  # layer 0: [2, KH, blocks, block_size, D]
    assert cache[:, :, :12].abs().sum() > 0  # 48 tokens = blocks 0..11 were written...
    assert cache[:, :, 12:].abs().sum() == 0  # ...and nothing past them
    assert engine.get_kv_cache_stats()["num_free_gpu_blocks"] == 64
    assert worker.warm_up() > 0
    warm = run_engine(engine, requests)
    monkeypatch.setattr(Worker, "warm_up", lambda self: 0.0)
    cold = run_engine(LLM(model=str(tiny_llama_dir), **kw).llm_engine, requests)
    assert {r: o.outputs[0].token_ids for r, o in warm.items()} == {
        r: o.outputs[0].token_ids for r, o in cold.items()
    }
    if TEST_DEVICE == "cpu":  # float32 on CPU: skipped (no oneDNN primitives to build)
        assert LLM(model=str(tiny_llama_dir), **ENGINE).llm_engine.executor.warm_up() == 0.0


def test_outputs_report_prefix_cache_hits(tiny_llama_dir, prompts):
    """Adversarial find: ``RequestOutput.num_cached_tokens`` stayed 0 while hits were counted."""
    llm = LLM(
        model=str(tiny_llama_dir), **ENGINE, block_size=4, num_gpu_blocks=64, enable_prefix_caching=True
    )
    p = prompts[2]  # 33 tokens: 8 full blocks
    first = llm.generate({"prompt_token_ids": p}, greedy(max_tokens=2), use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": p}, greedy(max_tokens=2), use_tqdm=False)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("mode", ["swap", "recompute", None])
def test_n_greater_than_one_shares_prompt_copy_on_write(tiny_llama_dir, prompts, references, mode):
    """n=3 greedy samples fork one prefill; every sample equals the reference, also when the
    cache is small enough to preempt (swap, forced recompute, or the default choice)."""
    llm = LLM(
        model=str(tiny_llama_dir),
        **ENGINE,
        block_size=4,
        num_gpu_blocks=40,
        num_cpu_blocks=80,
        preemption_mode=mode,
    )
    finals = run_engine(llm.llm_engine, [(f"r{i}", p, greedy(n=3)) for i, p in enumerate(prompts)])
    check_all(finals, references, n=3)


class _EvenBlocksSwap:
    """A preemption price under which a group swaps exactly when it holds an even number of
    blocks: both modes, and switches between them, in one run."""

    def recompute_s(self, num_tokens, num_seqs):
        return 1.0

    def swap_s(self, num_blocks):
        return 0.5 if num_blocks % 2 == 0 else 2.0


@pytest.mark.parametrize("chunked", [False, True])
def test_auto_preemption_keeps_greedy_output(tiny_llama_dir, prompts, references, chunked):
    """preemption_mode=auto, with a price that mixes swap and recompute, on a cache small
    enough to preempt (n=1 and n=2 requests): every sample equals transformers (near-ties
    aside) and forced recompute's output."""
    kw = dict(
        **ENGINE,
        block_size=4,
        num_gpu_blocks=28,
        num_cpu_blocks=64,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=24 if chunked else None,
    )
    requests = [(f"r{i}", p, greedy(n=1 + i % 2)) for i, p in enumerate(prompts)]
    auto = LLM(model=str(tiny_llama_dir), preemption_mode="auto", **kw).llm_engine
    auto.scheduler.preemption_cost = _EvenBlocksSwap()
    finals = run_engine(auto, requests)
    stats = auto.get_kv_cache_stats()
    assert stats["num_swap_preemptions"] > 0 and stats["num_recompute_preemptions"] > 0, stats
    assert stats["num_recomputed_tokens"] > 0 and stats["num_swapped_out_blocks"] > 0
    recompute = run_engine(
        LLM(model=str(tiny_llama_dir), preemption_mode="recompute", **kw).llm_engine, requests
    )
    for i, ref in enumerate(references):
        out = finals[f"r{i}"]
        assert out.outcome == "finished" and len(out.outputs) == 1 + i % 2
        for c, r in zip(out.outputs, recompute[f"r{i}"].outputs):
            if not compare(c.token_ids, ref):  # no near-tie: equal to recompute's in full
                assert c.token_ids == r.token_ids


def test_aborts_free_every_block(tiny_llama_dir, prompts):
    """Abort requests while waiting, running and swapped: each gets exactly one final output
    with finish_reason 'abort' and no block stays in use."""
    llm = LLM(
        model=str(tiny_llama_dir),
        **ENGINE,
        block_size=4,
        # the longest request (50 + 40 tokens, n=2 greedy) just fits: 23 blocks + 1 partial copy
        num_gpu_blocks=24,
        num_cpu_blocks=64,
        preemption_mode="swap",
        max_num_seqs=4,
    )
    engine = llm.llm_engine
    for i, p in enumerate(prompts * 2):
        engine.add_request(f"a{i}", {"prompt_token_ids": p}, greedy(max_tokens=40, n=2 if i % 2 else 1))
    seen_queues = set()
    finals = {}
    for step in range(2000):
        if not engine.has_unfinished_requests():
            break
        s = engine.scheduler
        for queue_name in ("waiting", "running", "swapped"):
            queue = getattr(s, queue_name)
            if queue and queue_name not in seen_queues and step >= 2:
                engine.abort_request(queue[-1].request_id)
                seen_queues.add(queue_name)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
    assert len(finals) == len(prompts) * 2
    aborted = [o for o in finals.values() if o.outcome == "aborted"]
    assert len(aborted) >= 2
    assert all(c.finish_reason == "abort" for o in aborted for c in o.outputs)
    assert_idle(engine)


def test_stop_conditions_free_blocks(tiny_llama_dir, prompts, references):
    """max_tokens and stop_token_ids end sequences; the stop token is kept in token_ids."""
    llm = LLM(model=str(tiny_llama_dir), **ENGINE, block_size=4, num_gpu_blocks=64)
    ref = references[1].token_ids
    stop_id = ref[5]
    first = ref.index(stop_id)
    finals = run_engine(
        llm.llm_engine,
        [("r0", prompts[1], greedy(stop_token_ids=[stop_id])), ("r1", prompts[1], greedy(max_tokens=3))],
    )
    assert finals["r0"].outputs[0].token_ids == ref[: first + 1]
    assert finals["r0"].outputs[0].finish_reason == "stop" and finals["r0"].outputs[0].stop_reason == stop_id
    assert finals["r1"].outputs[0].token_ids == ref[:3] and finals["r1"].outputs[0].finish_reason == "length"


def test_seeded_sampling_reproducible_across_batches(tiny_llama_dir, prompts):
    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, n=2)
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
    mixed = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [params] + [SamplingParams(max_tokens=12, temperature=0.9, ignore_eos=True)] * (len(prompts) - 1),
        use_tqdm=False,
    )[0]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in mixed.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids


def test_ignored_prompt_reports_reason_and_does_not_block(tiny_llama_dir):
    llm = LLM(
        model=str(tiny_llama_dir),
        **ENGINE,
        block_size=4,
        num_gpu_blocks=8,
        max_num_batched_tokens=64,
        max_model_len=64,
    )
    outs = llm.generate(
        [{"prompt_token_ids": list(range(5, 45))}, {"prompt_token_ids": [5, 6, 7]}],
        greedy(max_tokens=4),
        use_tqdm=False,
    )
    assert outs[0].outcome == "rejected" and outs[0].outputs[0].finish_reason == "ignored"
    assert "10 KV blocks > 8" in outs[0].error
    assert outs[1].outcome == "finished" and len(outs[1].outputs[0].token_ids) == 4
    assert_idle(llm.llm_engine)


def test_unknown_model_paths_rejected(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(tmp_path))
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(model=str(tmp_path), not_a_setting=1)


@pytest.mark.parametrize("chunked", [False, True])
def test_backfill_keeps_greedy_answers(tiny_llama_dir, prompts, references, chunked):
    """Backfill on a cache too small for the 50-token prompt beside the ones before it: shorter
    prompts pass it (and may be reclaimed for it); every answer still equals transformers."""
    llm = LLM(
        model=str(tiny_llama_dir),
        **ENGINE,
        block_size=4,
        num_gpu_blocks=24,
        num_cpu_blocks=64,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=24 if chunked else None,
        scheduling_backfill=True,
    )
    engine = llm.llm_engine
    finals = run_engine(engine, [(f"r{i}", p, greedy()) for i, p in enumerate(prompts)])
    check_all(finals, references)
    assert engine.scheduler.num_backfilled > 0
