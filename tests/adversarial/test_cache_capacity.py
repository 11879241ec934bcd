"""A request whose prompt fits the KV cache but whose generation outgrows it.

The cache, not the request, is the limit here: the prompt was admissible and the tokens
generated so far are valid output. The request must end *finished* with
``finish_reason="length"`` and keep its tokens (the greedy prefix of a roomy run) instead of
being reported as a rejected prompt (which the server turned into a 400 after the work was
done, discarding the output). Blocks are all freed.
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
def test_generation_outgrowing_the_cache_finishes_with_length(tiny_llama_dir, roomy, chunked, n):
    llm = _llm(tiny_llama_dir, enable_chunked_prefill=chunked, max_num_batched_tokens=16 if chunked else 64)
    out = llm.generate(
        [{"prompt_token_ids": PROMPT}],
        SamplingParams(n=n, max_tokens=40, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert out.outcome == "finished", (out.outcome, out.error)
    assert len(out.outputs) == n
    for c in out.outputs:
        assert c.finish_reason == "length"
        assert 0 < len(c.token_ids) < 40
        assert c.token_ids == roomy[: len(c.token_ids)]
    assert "KV blocks" in out.error  # why it stopped short of max_tokens
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
def test_server_answers_200_length_when_generation_outgrows_the_cache(tiny_server, stream):
    # 24 blocks x 4 = 96 slots; n=3 samples of up to 100 tokens can never all fit, but the
    # 3-token prompt is admissible: 200 with the tokens made, finish_reason "length".
    import json

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
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            assert not any("error" in e for e in events), events[-1]
            reasons = {
                c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")
            }
        else:
            reasons = {c["index"]: c["finish_reason"] for c in r.json()["choices"]}
            assert all(c["text"] for c in r.json()["choices"])
    assert reasons == {0: "length", 1: "length", 2: "length"}
    tiny_server.wait_idle()
