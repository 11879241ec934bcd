"""vLLM's ``bad_words``, ``allowed_token_ids``, ``truncate_prompt_tokens`` and sampling
``best_of`` over HTTP: applied (the text equals transformers' greedy tokens under the field's
rule, decoded), and bad values are a 400 naming the field."""

import pytest
import torch

from kvserve.engine.input_processor import bad_words_token_ids
from tests.adversarial.conftest import TINY_SERVER_KWARGS
from tests.engine.test_sampling_fields import hf_greedy
from tests.server_harness import running_server

PROMPT = [1, 504, 3458, 314, 4476, 10, 1204, 77]
MSGS = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from kvserve.config import EngineArgs

    with running_server(
        EngineArgs(model=str(tiny_llama_dir), **TINY_SERVER_KWARGS), "tiny", shutdown_grace_s=2.0
    ) as s:
        yield s


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def _complete(server, **body):
    with server.http() as h:
        r = h.post(
            "/v1/completions",
            json={"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True, **body},
        )
    return r


@pytest.mark.parametrize(
    "route,body,param,words",
    [
        ("/v1/completions", {"allowed_token_ids": [5, 49152]}, "allowed_token_ids", ["49152"]),
        ("/v1/chat/completions", {"allowed_token_ids": []}, "allowed_token_ids", ["empty"]),
        ("/v1/completions", {"logit_bias": {"5": 1, "05": 2}}, "logit_bias", ["token 5", "'05'"]),
        ("/v1/chat/completions", {"logit_bias": {"7": 1, "007": 2}}, "logit_bias", ["token 7"]),
        ("/v1/completions", {"truncate_prompt_tokens": 129}, "truncate_prompt_tokens", ["128"]),
        ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ["-1"]),
        ("/v1/chat/completions", {"bad_words": [" "]}, "bad_words", ["non-empty"]),
        ("/v1/completions", {"n": 2, "best_of": 1}, "best_of", [">= n"]),
        ("/v1/completions", {"best_of": 3, "stream": True}, "best_of", ["stream"]),
        ("/v1/completions", {"best_of": 9}, "best_of", ["max_num_seqs"]),
        ("/v1/completions", {"use_beam_search": True, "bad_words": ["x"]}, "bad_words", ["beam"]),
    ],
)
def test_bad_values_are_a_400_naming_the_field(server, route, body, param, words):
    plain = {"messages": MSGS} if "chat" in route else {"prompt": PROMPT}
    with server.http() as h:
        r = h.post(route, json={"model": "tiny", "max_tokens": 2, **plain, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert all(w in err["message"] for w in words), err
    assert err["code"] != "context_length_exceeded", err  # each is a bad setting, not an overflow
    server.wait_idle()


def test_allowed_token_ids_over_http(server, tok, tiny_hf_model):
    allowed = [1000, 2000, 3000, 4000]
    keep = torch.zeros(49152, dtype=torch.bool)
    keep[allowed] = True
    ref = hf_greedy(tiny_hf_model, PROMPT, 4, lambda x, _: x.masked_fill(~keep, float("-inf")))
    r = _complete(server, prompt=PROMPT, allowed_token_ids=allowed)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode(ref)
    server.wait_idle()


def test_bad_words_over_http(server, tok, tiny_hf_model):
    plain = hf_greedy(tiny_hf_model, PROMPT, 4)
    word = tok.decode(plain[:1])
    seqs = bad_words_token_ids([word], tok, 49152)

    def mask(x, out):
        x = x.clone()
        for s in seqs:
            if len(s) == 1 or out[len(out) - len(s) + 1 :] == s[:-1]:
                x[s[-1]] = float("-inf")
        return x

    ref = hf_greedy(tiny_hf_model, PROMPT, 4, mask)
    assert ref != plain
    r = _complete(server, prompt=PROMPT, bad_words=[word])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode(ref)
    server.wait_idle()


def test_truncate_prompt_tokens_over_http(server, tok, tiny_hf_model):
    long_prompt = list(range(100, 300))  # 200 tokens > max_model_len 128
    ref = hf_greedy(tiny_hf_model, long_prompt[-6:], 4)
    r = _complete(server, prompt=long_prompt, truncate_prompt_tokens=6)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == tok.decode(ref)
    assert body["usage"]["prompt_tokens"] == 6
    server.wait_idle()


def test_best_of_without_beam_search_returns_n_samples(server):
    r = _complete(server, prompt=PROMPT, n=2, best_of=4, temperature=1.0, seed=3, logprobs=0)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    # the best first: cumulative logprobs in descending order
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in choices]
    assert sums[0] >= sums[1] - 1e-4
    server.wait_idle()
