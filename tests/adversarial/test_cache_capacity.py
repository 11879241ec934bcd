"""A request whose prompt fits the KV cache but whose generation would outgrow it.

The cache is a context limit like ``max_model_len``: a ``max_tokens`` it can never hold is
refused before any work (a ``ValueError`` offline, a 400 naming ``max_tokens`` over HTTP), never
answered with fewer tokens than asked; without ``max_tokens`` generation stops where the cache
is full, ``finished`` with ``finish_reason="length"`` and the greedy prefix of a roomy run. A
prompt that alone overflows the cache is still rejected. Blocks are all freed.
"""

import pytest

from kvserve import LLM, SamplingParams

BS, G = 4, 8  # 32 token slots
PROMPT = list(range(100, 108))  # 8 tokens = 2 blocks


def _llm(model_dir, **kw):
    args = dict(
        block_size=BS,
        num_gpu_blocks=G,
        num_cpu_blocks=4,
        max_model_len=64,
        max_num_batched_tokens=64,
        watermark=0.0,
        seed=0,
    )
    args.update(kw)
    return LLM(model=str(model_dir), **args)


@pytest.fixture(scope="module")
def roomy(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, num_gpu_blocks=64)
    out = llm.generate(
        [{"prompt_token_ids": PROMPT}],
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    return out[0].outputs[0].token_ids


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("n", [1, 2])
def test_max_tokens_the_cache_cannot_hold_is_refused_before_any_work(tiny_llama_dir, chunked, n):
    llm = _llm(tiny_llama_dir, enable_chunked_prefill=chunked, max_num_batched_tokens=16 if chunked else 64)
    with pytest.raises(ValueError, match=r"^prompt \(8 tokens\) \+ max_tokens \(40\).*KV cache"):
        llm.generate(
            [{"prompt_token_ids": PROMPT}],
            SamplingParams(n=n, max_tokens=40, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
    st = llm.llm_engine.get_kv_cache_stats()
    assert st["num_free_gpu_blocks"] == G and not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("n", [1, 2])
def test_without_max_tokens_generation_stops_where_the_cache_is_full(tiny_llama_dir, roomy, chunked, n):
    llm = _llm(tiny_llama_dir, enable_chunked_prefill=chunked, max_num_batched_tokens=16 if chunked else 64)
    out = llm.generate(
        [{"prompt_token_ids": PROMPT}],
        SamplingParams(n=n, max_tokens=None, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert out.outcome == "finished" and out.error is None, (out.outcome, out.error)
    assert len(out.outputs) == n
    # 32 slots hold a sequence of 33 tokens (its last is never cached); greedy sequences are
    # the same tokens, and each one past the first holds a partial block of its own
    made = 33 - len(PROMPT) - (n - 1) * BS
    for c in out.outputs:
        assert c.finish_reason == "length" and c.token_ids == roomy[:made]
    st = llm.llm_engine.get_kv_cache_stats()
    assert st["num_free_gpu_blocks"] == G and st["num_free_cpu_blocks"] == 4
    assert not llm.llm_engine.has_unfinished_requests()


def test_prompt_that_never_fits_is_still_rejected(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    out = llm.generate(
        [{"prompt_token_ids": list(range(100, 133))}],
        SamplingParams(max_tokens=2, temperature=0),
        use_tqdm=False,
    )[0]
    assert out.outcome == "rejected" and out.outputs[0].finish_reason == "ignored"
    assert "9" in out.error and "8" in out.error


@pytest.mark.parametrize("stream", [False, True])
def test_server_refuses_max_tokens_the_cache_cannot_hold(tiny_server, stream):
    # 24 blocks x 4 = 96 slots; n=3 samples of up to 100 tokens can never all fit: a 400 naming
    # max_tokens before any work, not an answer cut short with finish_reason "length"
    body = {
        "model": "tiny",
        "prompt": [5, 6, 7],
        "max_tokens": 100,
        "n": 3,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    with tiny_server.http() as h:
        r = h.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    assert "KV cache" in err["message"] and "(3 tokens)" in err["message"]
    tiny_server.wait_idle()
