"""``fair``'s preemption by share on the tiny random-weight Llama: with room in the host pool
the victims are swapped out and back (unset preemption mode), and every request's greedy output
still equals transformers'."""

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import SamplingParams
from kvserve.config import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoints.openai.metrics import ServerMetrics
from tests.golden import TEST_DEVICE, compare, hf_greedy

MAX_NEW = 16


def test_share_victims_swap_and_greedy_equals_transformers(tiny_llama_dir, tiny_hf_model):
    rng = random.Random(3)
    a = [[rng.randrange(3, 49152) for _ in range(n)] for n in (30, 12, 41, 25, 18, 36)]
    b = [[rng.randrange(3, 49152) for _ in range(n)] for n in (22, 9)]
    eng = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(tiny_llama_dir),
            device=TEST_DEVICE,
            dtype="float32",
            policy="fair",
            block_size=4,
            num_gpu_blocks=48,  # A's six fill it: B must preempt to start
            num_cpu_blocks=64,
            max_model_len=128,
        )
    )
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(a):
        eng.add_request(f"a{i}", {"prompt_token_ids": p}, params, tenant="A")
    outs = {}
    steps = 0
    while eng.has_unfinished_requests():
        if steps == 3:
            for i, p in enumerate(b):
                eng.add_request(f"b{i}", {"prompt_token_ids": p}, params, tenant="B")
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        eng.scheduler.block_manager.check_invariants()
        steps += 1
        assert steps < 2000
    stats = eng.get_kv_cache_stats()
    assert stats["num_rank_swap_preemptions"] >= 1
    assert stats["num_rank_recomputed_tokens"] == 0
    assert stats["num_free_gpu_blocks"] == 48 and stats["num_free_cpu_blocks"] == 64
    # the same counts on /metrics
    text = ServerMetrics(eng, "m").render().decode()
    scraped = {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("kvserve:rank_")
    }
    assert scraped == {
        "kvserve:rank_preemptions_total": stats["num_rank_preemptions"],
        "kvserve:rank_swap_preemptions_total": stats["num_rank_swap_preemptions"],
        "kvserve:rank_recomputed_tokens_total": 0,
    }
    prompts = {**{f"a{i}": p for i, p in enumerate(a)}, **{f"b{i}": p for i, p in enumerate(b)}}
    assert set(outs) == set(prompts)
    for rid, p in prompts.items():
        compare(list(outs[rid]), hf_greedy(tiny_hf_model, p, MAX_NEW))


def test_fair_only_setting_under_fcfs_is_refused_before_the_weights_load(tiny_llama_dir, monkeypatch):
    """A weight the policy would ignore is refused before the (long) model load, not after it."""
    from kvserve.worker.worker import Worker

    def no_load(*args, **kwargs):
        raise AssertionError("the model started loading")

    monkeypatch.setattr(Worker, "__init__", no_load)
    with pytest.raises(
        ValueError, match=r"^tenant_weights only applies to the 'fair' scheduling policy, not 'fcfs'"
    ):
        LLMEngine.from_engine_args(
            EngineArgs(model=str(tiny_llama_dir), device=TEST_DEVICE, policy="fcfs", tenant_weights="a=2")
        )
