"""The request size caps of ``field_limits`` (prompts x n, prompts x best_of, prompt-logprob
entries, modelled prefill cost): a ValueError naming the field and the limit offline, a 400
naming them over HTTP, and the sizes legitimate use needs still accepted."""

import random

import httpx
import pytest

from kvserve import LLM, BeamSearchParams, SamplingParams
from kvserve.engine.input_processor import validate_request
from kvserve.field_limits import (
    MAX_PROMPT_LOGPROB_ENTRIES,
    MAX_REQUEST_PREFILL_COST,
    MAX_REQUEST_SEQUENCES,
    check_request_size,
    prefill_cost,
    prompt_logprob_entries,
)
from tests.golden import TEST_DEVICE


def test_legitimate_sizes_pass():
    # prompt_logprobs 20 on a full 8,192-token prompt, and on 16 prompts of 300 tokens
    check_request_size([8192], prompt_logprobs=20)
    check_request_size([300] * 16, n=2, prompt_logprobs=20)
    # the largest prompt list at n=1, a single prompt at n=256, 64 prompts x 10 beams
    check_request_size([128] * 1024)
    check_request_size([8192] * 16)
    check_request_size([65536], prompt_logprobs=0)
    check_request_size([100], n=256)
    check_request_size([300] * 64, best_of=10)
    assert prompt_logprob_entries([8192], 20) == 8191 * 21
    assert prefill_cost([10, 5], None) == 15 and prefill_cost([10, 5], 3) == 15 + 13
    assert prompt_logprob_entries([10], None) == 0


@pytest.mark.parametrize(
    "lens,kw,field,limit",
    [
        ([1] * 1024, dict(n=2), "n", MAX_REQUEST_SEQUENCES),
        ([1] * 103, dict(best_of=10), "best_of", MAX_REQUEST_SEQUENCES),
        ([8192] * 2, dict(prompt_logprobs=20), "prompt_logprobs", MAX_PROMPT_LOGPROB_ENTRIES),
        ([129] * 1024, dict(), "prompt", MAX_REQUEST_PREFILL_COST),
        ([8192] * 20, dict(prompt_logprobs=0), "prompt", MAX_REQUEST_PREFILL_COST),
    ],
)
def test_past_a_cap_is_a_value_error_naming_field_and_limit(lens, kw, field, limit):
    with pytest.raises(ValueError) as e:
        check_request_size(lens, **kw)
    message = str(e.value)
    assert message.startswith(field + " ") and str(limit) in message, message


def test_offline_engine_request_past_the_entry_cap_is_refused():
    """One engine request (``validate_request``, behind ``LLMEngine.add_request``)."""
    rng = random.Random(0)
    n = MAX_PROMPT_LOGPROB_ENTRIES // 21 + 2  # (n - 1) x 21 entries > the cap
    ids = [rng.randrange(3, 1000) for _ in range(n)]
    kw = dict(vocab_size=1000, max_model_len=2 * n, max_num_seqs=256)
    with pytest.raises(ValueError, match=rf"^prompt_logprobs .*{MAX_PROMPT_LOGPROB_ENTRIES}"):
        validate_request(ids, SamplingParams(max_tokens=1, prompt_logprobs=20), **kw)
    # the same prompt with fewer top logprobs fits
    assert validate_request(ids, SamplingParams(max_tokens=1, prompt_logprobs=5), **kw) == 1


def test_offline_beam_search_past_prompts_x_best_of_is_refused(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), device=TEST_DEVICE, dtype="float32")
    prompts = [{"prompt_token_ids": [5, 6, 7]}] * (MAX_REQUEST_SEQUENCES // 10 + 1)
    with pytest.raises(ValueError, match=rf"^best_of .*{MAX_REQUEST_SEQUENCES}"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=10, max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from kvserve.config import EngineArgs
    from tests.server_harness import running_server

    args = EngineArgs(model=str(tiny_llama_dir), device=TEST_DEVICE, dtype="float32", max_num_seqs=32)
    with running_server(args, "tiny") as s:
        yield s


def _ids(rng, n):
    return [rng.randrange(3, 49152) for _ in range(n)]


@pytest.mark.parametrize(
    "case,param,limit",
    [
        ("n", "n", MAX_REQUEST_SEQUENCES),
        ("best_of", "best_of", MAX_REQUEST_SEQUENCES),
        ("prompt_logprobs", "prompt_logprobs", MAX_PROMPT_LOGPROB_ENTRIES),
        ("echo", "logprobs", MAX_PROMPT_LOGPROB_ENTRIES),
        ("cost", "prompt", MAX_REQUEST_PREFILL_COST),
    ],
)
def test_http_past_a_cap_is_a_400_naming_field_and_limit(server, case, param, limit):
    rng = random.Random(1)
    long_prompts = [_ids(rng, 255) for _ in range(MAX_PROMPT_LOGPROB_ENTRIES // (254 * 21) + 1)]
    body = {
        "n": dict(prompt=[[5, 6]] * (MAX_REQUEST_SEQUENCES // 2 + 1), n=2, max_tokens=1),
        "best_of": dict(
            prompt=[[5, 6]] * (MAX_REQUEST_SEQUENCES // 10 + 1),
            use_beam_search=True,
            best_of=10,
            temperature=0,
            max_tokens=2,
        ),
        "prompt_logprobs": dict(prompt=long_prompts, prompt_logprobs=20, max_tokens=1),
        "echo": dict(prompt=long_prompts, echo=True, logprobs=20, max_tokens=1),
        "cost": dict(prompt=[_ids(rng, 255) for _ in range(1024)], prompt_logprobs=0, max_tokens=1),
    }[case]
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/completions", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and str(limit) in err["message"], err
    assert server.wait_idle()["num_free_gpu_blocks"] > 0
    # the same server answers a legitimate request right after
    with httpx.Client(base_url=server.url, timeout=120) as c:
        ok = c.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": [[5, 6, 7]] * 4, "prompt_logprobs": 20, "max_tokens": 2},
        )
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"]) == 4
