"""``logit_bias`` on a token id the tokenizer lacks: a model whose vocabulary is padded past
its tokenizer's (49,152 + 64 rows here, as Qwen2's 151,936 rows over 151,665 tokens) has ids
that decode to nothing. A +100 bias on one of them made every sampled token that id and the
text empty (a silent 200). Such a key is refused now, as OpenAI refuses ids outside its
vocabulary: a ``ValueError`` (HTTP 400, ``param`` ``logit_bias``) naming the valid range, which
is ``[0, min(vocab_size, len(tokenizer)))`` either way round."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.engine.input_processor import validate_request

TOKENIZER_SIZE = 49152
PADDED_VOCAB = TOKENIZER_SIZE + 64
ENGINE = dict(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8, max_model_len=64, seed=0)


@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory, default_tokenizer_dir):
    from tests.conftest import _save_tiny, tiny_llama_config

    config = tiny_llama_config(vocab_size=PADDED_VOCAB)
    return _save_tiny(tmp_path_factory, default_tokenizer_dir, "tiny-llama-padded-vocab", config)


@pytest.fixture(scope="module")
def padded_llm(padded_dir):
    return LLM(model=str(padded_dir), **ENGINE)


def _idle(llm):
    eng = llm.llm_engine
    st_ = eng.get_kv_cache_stats()
    assert not eng.has_unfinished_requests()
    assert st_["num_free_gpu_blocks"] == st_["num_gpu_blocks"]


def test_padded_model_has_more_rows_than_its_tokenizer(padded_llm):
    eng = padded_llm.llm_engine
    assert eng.vocab_size == PADDED_VOCAB and eng.tokenizer_size == TOKENIZER_SIZE


@pytest.mark.parametrize("token", [TOKENIZER_SIZE, PADDED_VOCAB - 1])
def test_logit_bias_on_a_token_the_tokenizer_lacks_is_value_error_naming_the_range(padded_llm, token):
    params = SamplingParams(max_tokens=4, temperature=0, logit_bias={token: 100})
    with pytest.raises(ValueError, match=rf"^logit_bias must be token ids in \[0, {TOKENIZER_SIZE}\)") as e:
        padded_llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert str(token) in str(e.value) and f"vocab_size {PADDED_VOCAB}" in str(e.value)
    _idle(padded_llm)


def test_logit_bias_on_the_last_shared_token_still_steers_the_output(padded_llm):
    last = TOKENIZER_SIZE - 1
    params = SamplingParams(max_tokens=4, temperature=0, logit_bias={last: 100})
    out = padded_llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [last] * 4 and out.text  # a real token: it shows in the text
    _idle(padded_llm)


def test_logit_bias_past_a_smaller_model_vocab_names_the_model_vocab():
    """The reverse: a tokenizer larger than the model (here len 49,152 over 1,000 rows)."""
    params = SamplingParams(max_tokens=2, logit_bias={1000: 5})
    with pytest.raises(ValueError, match=r"logit_bias must be token ids in \[0, 1000\)"):
        validate_request([5], params, vocab_size=1000, max_model_len=64, max_num_seqs=4, tokenizer_size=49152)


@settings(max_examples=200, deadline=None)
@given(
    vocab=st.integers(1, 70_000),
    tok=st.one_of(st.none(), st.integers(1, 70_000)),
    keys=st.lists(st.integers(0, 80_000), min_size=1, max_size=4),
)
def test_logit_bias_keys_are_accepted_iff_both_model_and_tokenizer_have_them(vocab, tok, keys):
    limit = vocab if tok is None else min(vocab, tok)
    params = SamplingParams(max_tokens=1, logit_bias={k: 1.0 for k in keys})
    kw = dict(vocab_size=vocab, max_model_len=64, max_num_seqs=4, tokenizer_size=tok)
    if max(keys) < limit:
        assert validate_request([0], params, **kw) == 1
    else:
        with pytest.raises(ValueError, match=rf"^logit_bias must be token ids in \[0, {limit}\)"):
            validate_request([0], params, **kw)


def test_server_answers_400_naming_logit_bias_for_a_token_the_tokenizer_lacks(padded_dir):
    from kvserve.config import EngineArgs
    from tests.server_harness import running_server

    with running_server(EngineArgs(model=str(padded_dir), **ENGINE), "padded") as srv, srv.http() as c:
        for path, body in (
            ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        ):
            r = c.post(path, json={"model": "padded", "logit_bias": {str(TOKENIZER_SIZE + 3): 100}, **body})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "logit_bias"
            assert f"[0, {TOKENIZER_SIZE})" in err["message"] and str(TOKENIZER_SIZE + 3) in err["message"]
            ok = c.post(path, json={"model": "padded", "logit_bias": {str(TOKENIZER_SIZE - 1): 100}, **body})
            assert ok.status_code == 200, ok.text
        srv.wait_idle()
