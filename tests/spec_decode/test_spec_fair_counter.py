"""The ``fair`` policy's counter under speculative decoding: a tenant is charged the output
tokens it was served (accepted drafts included), so its counter equals the counter of the same
requests run without speculation and the closed form prompt x input weight + (output - 1) x
output weight per request (the first output token comes from the prefill step)."""

from kvserve.engine.llm_engine import LLMEngine
from tests.spec_decode.test_spec_decode_engine import ENGINE, PROMPTS, greedy, ngram, pool_sizes

MAX_NEW = 24


def served_counter(model_dir, spec):
    """Run ``PROMPTS`` for tenant ``a`` under ``fair``; returns (its counter once idle: the
    policy's floor, engine stats, outputs by id)."""
    from kvserve.config import EngineArgs

    eng = LLMEngine.from_engine_args(
        EngineArgs(model=str(model_dir), **ENGINE, speculative_config=spec, policy="fair", **pool_sizes({}))
    )
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(MAX_NEW), tenant="a")
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    # the last backlogged tenant going idle leaves the floor at its counter
    return eng.scheduler.policy.floor(), eng.stats, outs


def test_accepted_drafts_are_charged_as_output_tokens(tiny_llama_dir):
    spec_counter, stats, spec_out = served_counter(tiny_llama_dir, ngram())
    assert stats.spec_num_accepted_tokens > 0, "repetitive prompts must get drafts accepted"
    plain_counter, _, plain_out = served_counter(tiny_llama_dir, None)
    assert spec_out == plain_out
    want = sum(len(p) * 1.0 + (len(spec_out[f"r{i}"]) - 1) * 2.0 for i, p in enumerate(PROMPTS))
    assert plain_counter == want
    assert spec_counter == want
