"""Failure scenarios from ../shared/scenarios/README.md, run through the real engine and model.

(The scheduler-level versions, driven by the simulated executor, live in tests/core/.)
"""

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.sequence import SequenceStatus
from tests.engine.test_e2e_tiny import assert_idle, run_engine


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def test_B01_prompt_over_prompt_limit_is_ignored_in_first_step(tiny_llama_dir):
    llm = LLM(
        model=str(tiny_llama_dir),
        block_size=4,
        num_gpu_blocks=64,
        num_cpu_blocks=0,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
        preemption_mode="recompute",
        enable_chunked_prefill=False,
    )  # prompt_limit = min(max_model_len, budget) without chunking
    engine = llm.llm_engine
    p = SamplingParams(max_tokens=4, temperature=0)
    engine.add_request("R1", {"prompt_token_ids": _ids(40, 1)}, p)
    engine.add_request("R2", {"prompt_token_ids": _ids(8, 2)}, p)
    first = {o.request_id: o for o in engine.step()}
    assert first["R1"].finished and first["R1"].outcome == "rejected"
    assert "40" in first["R1"].error and "32" in first["R1"].error
    finals = run_engine(engine, [])
    assert finals["R2"].outputs[0].finish_reason in ("length", "stop")
    assert engine.get_kv_cache_stats()["num_free_gpu_blocks"] == 64


def test_B01_variant_a_chunked_prefill_runs_long_prompt_in_chunks(tiny_llama_dir):
    llm = LLM(
        model=str(tiny_llama_dir),
        block_size=4,
        num_gpu_blocks=64,
        num_cpu_blocks=0,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
        enable_chunked_prefill=True,
    )
    finals = run_engine(
        llm.llm_engine,
        [
            ("R1", _ids(40, 1), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)),
            ("R2", _ids(8, 2), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)),
        ],
    )
    assert len(finals["R1"].outputs[0].token_ids) == 4 and finals["R1"].outcome == "finished"


def test_B01_variant_b_prompt_over_max_model_len_rejected(tiny_llama_dir):
    llm = LLM(
        model=str(tiny_llama_dir),
        block_size=4,
        num_gpu_blocks=64,
        max_num_batched_tokens=32,
        max_model_len=64,
        enable_chunked_prefill=True,
    )
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": _ids(70, 1)}, SamplingParams(max_tokens=4), use_tqdm=False)
    assert_idle(llm.llm_engine)


def test_B03_prompt_bigger_than_block_pool_does_not_block_queue(tiny_llama_dir):
    llm = LLM(
        model=str(tiny_llama_dir),
        block_size=4,
        num_gpu_blocks=8,
        num_cpu_blocks=16,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        watermark=0.0,
    )
    outs = llm.generate(
        [{"prompt_token_ids": _ids(33, 1)}, {"prompt_token_ids": _ids(4, 2)}],
        SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert outs[0].outcome == "rejected" and "9" in outs[0].error and "8" in outs[0].error
    assert outs[1].outcome == "finished" and len(outs[1].outputs[0].token_ids) == 2
    # Boundary: exactly 8 blocks fits.
    out = llm.generate(
        {"prompt_token_ids": _ids(32, 3)},
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert out.outcome == "finished" and len(out.outputs[0].token_ids) == 1
    assert_idle(llm.llm_engine)


def test_B05_empty_prompt_offline_raises_and_engine_survives(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir))
    for prompt in ({"prompt_token_ids": []}, ""):
        with pytest.raises(ValueError, match="prompt"):
            llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    out = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)[
        0
    ]
    assert len(out.outputs[0].token_ids) == 3
    assert_idle(llm.llm_engine)


def test_B06_max_tokens_limits(tiny_llama_dir):
    llm = LLM(
        model=str(tiny_llama_dir),
        block_size=4,
        num_gpu_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=32,
    )
    prompt = {"prompt_token_ids": _ids(8, 1)}
    for bad in (0, -1, 2.5, "10"):
        with pytest.raises(ValueError, match="max_tokens"):
            llm.generate(prompt, SamplingParams(max_tokens=bad, temperature=0), use_tqdm=False)
    out = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)[
        0
    ]
    assert len(out.outputs[0].token_ids) == 24
    with pytest.raises(ValueError, match=r"8 tokens\) \+ max_tokens \(25\) = 33 > max_model_len \(32\)"):
        llm.generate(prompt, SamplingParams(max_tokens=25, temperature=0), use_tqdm=False)
    out = llm.generate(
        prompt, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 24 and out.outputs[0].finish_reason == "length"
    assert_idle(llm.llm_engine)


@pytest.mark.parametrize("variant", ["plain", "one_sample_stops_early"])
def test_B08_n2_groups_preempted_by_swap_never_recomputed_together(tiny_llama_dir, variant):
    llm = LLM(
        model=str(tiny_llama_dir),
        block_size=4,
        num_gpu_blocks=12,
        num_cpu_blocks=32,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=64,
    )
    engine = llm.llm_engine
    stop_ids = []
    if variant == "one_sample_stops_early":
        # Find a token sample 0 of R1 emits within 3 steps and sample 1 does not.
        probe = LLM(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=64, max_model_len=64)
        out = probe.generate(
            {"prompt_token_ids": _ids(8, 1)},
            SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=16, ignore_eos=True),
            use_tqdm=False,
        )[0]
        a, b = out.outputs[0].token_ids, out.outputs[1].token_ids
        stop_ids = [next(t for t in a[:3] if t not in b)]
    for i in range(1, 5):
        engine.add_request(
            f"R{i}",
            {"prompt_token_ids": _ids(8, i)},
            SamplingParams(
                n=2,
                temperature=1.0,
                seed=i,
                max_tokens=16,
                ignore_eos=True,
                stop_token_ids=stop_ids if i == 1 else None,
            ),
        )
    finals = {}
    while engine.has_unfinished_requests():
        for g in engine.scheduler.waiting:
            assert g.num_unfinished_seqs() <= 1 or not g.forked, "a multi-sequence group was recomputed"
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert all(len(o.outputs) == 2 for o in finals.values())
    if stop_ids:
        assert any(c.finish_reason == "stop" for c in finals["R1"].outputs)
    assert engine.get_kv_cache_stats()["num_preemptions"] > 0
    assert_idle(engine)


@pytest.mark.parametrize("chunked", [False, True])
def test_B11_recompute_keeps_outputs_as_outputs(tiny_llama_dir, chunked):
    prompts = [_ids(8, s) for s in (11, 12, 13)]
    params = [
        SamplingParams(
            max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3 if i == 1 else 1.0
        )
        for i in range(3)
    ]
    solo = LLM(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=64, max_model_len=64)
    refs = [
        solo.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0].token_ids
        for p, sp in zip(prompts, params)
    ]
    llm = LLM(
        model=str(tiny_llama_dir),
        block_size=4,
        num_gpu_blocks=10,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        preemption_mode="recompute",
        enable_chunked_prefill=chunked,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.get_kv_cache_stats()["num_preemptions"] >= 1
    for out, ref in zip(outs, refs):
        assert out.prompt_token_ids == out.prompt_token_ids[:8] and len(out.prompt_token_ids) == 8
        assert out.outputs[0].token_ids == ref
    assert_idle(llm.llm_engine)


@pytest.mark.parametrize("chunked", [False, True])
def test_B13_fully_cached_block_aligned_prompt(tiny_llama_dir, chunked):
    llm = LLM(
        model=str(tiny_llama_dir),
        block_size=4,
        num_gpu_blocks=32,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        enable_prefix_caching=True,
        enable_chunked_prefill=chunked,
    )
    engine = llm.llm_engine
    p8 = _ids(8, 5)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    a = llm.generate({"prompt_token_ids": p8}, params, use_tqdm=False)[0]
    b = llm.generate({"prompt_token_ids": p8}, params, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert engine.get_kv_cache_stats()["prefix_cache_hits"] > 0
    # Variant: 12-token prompt, B arrives while A decodes; A must equal a solo run.
    p12 = _ids(12, 6)
    solo = (
        llm.generate(
            {"prompt_token_ids": p12},
            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    engine.reset_prefix_cache()
    engine.add_request(
        "A", {"prompt_token_ids": p12}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )
    engine.step()
    engine.step()
    finals = run_engine(engine, [("B", p12, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))])
    assert finals["A"].outputs[0].token_ids == solo
    assert finals["B"].outputs[0].token_ids == solo
    assert engine.get_kv_cache_stats()["num_free_gpu_blocks"] == 32


@pytest.mark.parametrize("where", ["running", "swapped", "waiting"])
def test_B18_abort_n2_request_everywhere(tiny_llama_dir, where):
    llm = LLM(
        model=str(tiny_llama_dir),
        block_size=4,
        num_gpu_blocks=32,
        num_cpu_blocks=16,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
    )
    engine = llm.llm_engine
    # the longest two sampled sequences of a 6-token prompt can reach in 32 blocks of 4 (one
    # shared prompt block, 15 of their own each): three such requests contend for the cache
    long = SamplingParams(n=2, temperature=0.3, seed=1, ignore_eos=True, max_tokens=59)
    if where != "running":
        engine.add_request("X1", {"prompt_token_ids": _ids(6, 7)}, long)
        engine.add_request("X2", {"prompt_token_ids": _ids(6, 8)}, long)
    engine.add_request("R", {"prompt_token_ids": _ids(6, 1)}, long)
    group = engine._groups["R"]
    for _ in range(400):
        state = (
            "swapped"
            if group in engine.scheduler.swapped
            else "waiting"
            if group in engine.scheduler.waiting
            else "running"
        )
        if state == where and (where != "running" or engine.stats.num_steps >= 3):
            break
        engine.step()
    else:
        pytest.skip(f"R never reached {where}")
    engine.abort_request("R")
    outs = [o for o in engine.step() if o.request_id == "R"]
    assert len(outs) == 1 and outs[0].finished and outs[0].outcome == "aborted"
    assert all(s.status == SequenceStatus.FINISHED_ABORTED for s in group.get_seqs())
    while engine.has_unfinished_requests():
        for meta_out in engine.step():
            assert meta_out.request_id != "R"
    assert_idle(engine)
