"""A request whose logits hold a NaN or an infinity is never sampled: it ends ``failed`` with
that reason, and the other requests of the same step are sampled as without it."""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model_executor.sampler import NON_FINITE_LOGITS, Sampler, non_finite_rows
from kvserve.sequence import SequenceData
from tests.engine.test_e2e_tiny import assert_idle
from tests.model_executor.test_sampler import EOS, md, tokens


def test_non_finite_rows_names_exactly_the_rows_with_nan_or_inf():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g)
    logits[1, 7] = float("nan")
    logits[3, 0] = float("inf")
    logits[4, 299] = float("-inf")
    logits[5] = 3e38  # finite, but its sum overflows: not a fault
    assert non_finite_rows(logits) == [1, 3, 4]
    assert non_finite_rows(logits[[0, 2, 5]]) == []


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampler_leaves_a_non_finite_group_unsampled_and_the_others_as_alone(temperature):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 500, generator=g)
    params = SamplingParams(temperature=temperature, seed=None, logprobs=2)

    def metas():
        # group 1 has two sequences (rows 1 and 2); seeded generators make random rows
        # independent of the batch
        return [
            md(params, {0: SequenceData([1])}, seed_gen=5, request_id="a"),
            md(params, {1: SequenceData([1]), 2: SequenceData([2])}, seed_gen=6, request_id="bad"),
            md(params, {3: SequenceData([1])}, seed_gen=7, request_id="c"),
        ]

    alone = Sampler(EOS)(logits[[0, 3]].clone(), [metas()[0], metas()[2]])
    poisoned = logits.clone()
    poisoned[2, 10] = float("nan")  # one row of the two-sequence group
    outs = Sampler(EOS)(poisoned, metas())
    assert outs[1].error == NON_FINITE_LOGITS and outs[1].samples == []
    assert outs[0].error is None and outs[2].error is None
    assert tokens([outs[0], outs[2]]) == tokens(alone)
    assert [o.samples[0].top_logprobs for o in (outs[0], outs[2])] == [
        o.samples[0].top_logprobs for o in alone
    ]


#: A token id whose embedding row is made NaN: a prompt holding it gives NaN logits.
POISON = 4242


def test_nan_request_fails_naming_the_cause_and_its_batch_neighbour_is_unaffected(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), enable_prefix_caching=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    good = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13]}
    alone = llm.generate([good], params, use_tqdm=False)[0].outputs[0].token_ids
    model = llm.llm_engine.executor.model
    model.embed_tokens.data[POISON] = float("nan")
    bad = {"prompt_token_ids": [5, 6, POISON, 8]}
    outs = llm.generate([good, bad, good], params, use_tqdm=False)
    assert [o.outcome for o in outs] == ["finished", "failed", "finished"]
    assert outs[0].outputs[0].token_ids == alone and outs[2].outputs[0].token_ids == alone
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].outputs[0].token_ids == []
    assert NON_FINITE_LOGITS in outs[1].error and outs[1].request_id in outs[1].error
    # its blocks (NaN K/V) were freed without entering the prefix cache: later requests that
    # reuse them, or share its prefix, are exact
    assert_idle(llm.llm_engine)
    model.embed_tokens.data[POISON] = 0.0
    again = llm.generate([good, {"prompt_token_ids": [5, 6, POISON, 8]}], params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == alone and again[1].outcome == "finished"
    assert_idle(llm.llm_engine)


def test_http_nan_request_is_a_500_naming_the_cause_and_the_server_keeps_serving(tiny_llama_dir):
    from kvserve.config import EngineArgs
    from tests.server_harness import running_server

    args = EngineArgs(model=str(tiny_llama_dir), device="cpu", dtype="float32", seed=0)
    with running_server(args, "tiny") as s, s.http() as h:
        s.engine.executor.model.embed_tokens.data[POISON] = float("nan")
        body = {"model": "tiny", "max_tokens": 3, "temperature": 0}
        r = h.post("/v1/completions", json={**body, "prompt": [5, POISON, 7]})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "engine_step_failed" and NON_FINITE_LOGITS in err["message"], err
        with h.stream(
            "POST", "/v1/completions", json={**body, "prompt": [5, POISON, 7], "stream": True}
        ) as st:
            text = "".join(st.iter_text())
        assert NON_FINITE_LOGITS in text and "[DONE]" not in text.split(NON_FINITE_LOGITS)[0], text
        r = h.post("/v1/completions", json={**body, "prompt": [5, 6, 7]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        s.wait_idle()


def test_an_overflowed_hidden_state_fails_its_request_instead_of_answering_junk(tiny_llama_dir):
    # a finite but huge embedding row: its square overflows the RMS norms' mean square, which
    # then return all-zero rows, so the logits are finite and all equal (a junk answer)
    llm = LLM(model=str(tiny_llama_dir))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    good = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    alone = llm.generate([good], params, use_tqdm=False)[0].outputs[0].token_ids
    model = llm.llm_engine.executor.model
    model.embed_tokens.data[POISON] = 1e30
    outs = llm.generate([good, {"prompt_token_ids": [5, 6, POISON]}], params, use_tqdm=False)
    assert [o.outcome for o in outs] == ["finished", "failed"]
    assert outs[0].outputs[0].token_ids == alone
    assert NON_FINITE_LOGITS in outs[1].error
    assert_idle(llm.llm_engine)
