"""The default model (SmolLM2-135M-Instruct, float32) with speculation under chunked prefill,
prefix caching and preemption (recompute, swap), its KV cache small enough to preempt, for both
proposers: greedy output equals speculation off in the same engine token for token, drafts are
accepted, and blocks are conserved after every step.

The four two-way settings run as a pairwise covering array (every pair of settings meets in at
least one case: 5 cases instead of 16); the tiny model's engine test runs the full product
with the n-gram proposer."""

import pytest

from kvserve import SamplingParams
from tests.engine.test_e2e_tiny import run_engine
from tests.spec_decode.test_spec_decode_engine import check_blocks, make_engine

pytestmark = pytest.mark.slow

PASSAGE = (
    "The scheduler keeps three queues: waiting, running and swapped. Each step it admits new "
    "prompts while the token budget allows, decodes the running sequences and preempts the "
    "lowest ranked group when the KV cache is full."
)
TEXTS = [
    f"Repeat the following text exactly.\n\nText: {PASSAGE}\n\nRepeated text: The scheduler keeps",
    f"{PASSAGE}\n\nQuestion: what are the three queues called?\nAnswer: The three queues are",
    f"Copy this sentence: {PASSAGE[:90]}\nCopy:",
]
MAX_NEW = 16


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    from kvserve.transformers_utils.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    return [tok.encode(t) for t in TEXTS]


def _run(engine, prompts, tag):
    """All ``prompts`` plus the first again once its prompt is computed (a prefix-cache hit),
    block tables checked after every step; request id -> token ids."""

    def each_step(step):
        check_blocks(engine)
        if step == 3:
            engine.add_request(f"{tag}again", {"prompt_token_ids": prompts[0]}, _greedy())

    reqs = [(f"{tag}{i}", p, _greedy()) for i, p in enumerate(prompts)]
    finals = run_engine(engine, reqs, max_steps=2000, on_step=each_step)
    assert all(o.outcome == "finished" for o in finals.values())
    return {rid[len(tag) :]: o.outputs[0].token_ids for rid, o in finals.items()}


def _greedy():
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


#: (method, chunked, prefix, mode): a strength-2 covering array of four two-level factors
PAIRWISE = [
    ("ngram", False, False, "recompute"),
    ("ngram", True, True, "swap"),
    ("draft_model", False, True, "swap"),
    ("draft_model", True, False, "swap"),
    ("draft_model", True, True, "recompute"),
]


@pytest.mark.parametrize("method,chunked,prefix,mode", PAIRWISE)
def test_default_model_speculation_equals_off_in_every_pair_of_modes(
    default_model_dir, prompts, method, chunked, prefix, mode
):
    spec = {"method": method, "num_speculative_tokens": 4, "dynamic": False}
    if method == "draft_model":
        spec["model"] = str(default_model_dir)  # the target as its own draft: every draft checked
    else:
        spec |= {"prompt_lookup_min": 2, "prompt_lookup_max": 4, "disable_below_acceptance_rate": 0.0}
    eng = make_engine(
        default_model_dir,
        spec,
        num_gpu_blocks=12,  # 3-4 blocks of 16 per prompt + 2 of output: 4 requests preempt
        num_cpu_blocks=64,
        preemption_mode=mode,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=prefix,
        max_num_batched_tokens=32 if chunked else None,
    )
    on = _run(eng, prompts, "on")
    s = eng.stats
    drafted, accepted = s.spec_num_draft_tokens, s.spec_num_accepted_tokens
    assert drafted > 0 and accepted > 0
    if method == "draft_model":
        assert accepted >= 0.95 * drafted
    preemptions = eng.get_kv_cache_stats()["num_preemptions"]
    assert preemptions > 0, "the small cache must force preemption"
    eng.scheduler.num_lookahead_slots = 0  # the same engine with speculation off
    off = _run(eng, prompts, "off")
    assert s.spec_num_draft_tokens == drafted
    assert on == off
