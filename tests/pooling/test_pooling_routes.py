"""The pooling routes over a real server with a tiny BERT: values equal the offline API's and
transformers', and each bad input is a 400 naming its field."""

import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve.config import EngineArgs
from tests.pooling.tiny_bert import TEXTS, reference_embeddings, save_tiny_bert
from tests.server_harness import running_server

API_KEY = "k"
MODEL = "tiny-bert"


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert-routes"), pooling="MEAN", normalize=True)


@pytest.fixture(scope="module")
def server(bert_dir):
    with running_server(EngineArgs(model=str(bert_dir)), MODEL, api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def ref(bert_dir):
    return reference_embeddings(bert_dir, TEXTS, "MEAN", normalize=True)


def _post(server, path, body, key=API_KEY, timeout=60.0):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


def test_embeddings_float_base64_batch_and_ids(server, ref, bert_dir):
    r = _post(server, "/v1/embeddings", {"model": MODEL, "input": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL
    got = torch.tensor([d["embedding"] for d in body["data"]])
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    assert F.cosine_similarity(got, ref).min() >= 0.99999
    n_tokens = sum(len(server.engine.tokenizer(t).input_ids) for t in TEXTS)
    assert body["usage"] == {
        "prompt_tokens": n_tokens,
        "completion_tokens": 0,
        "total_tokens": n_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    r = _post(server, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vec, got[0].numpy(), atol=1e-6)
    ids = server.engine.tokenizer(TEXTS[1]).input_ids
    r = _post(server, "/v1/embeddings", {"input": [ids, ids]})
    data = r.json()["data"]
    assert len(data) == 2 and np.allclose(data[0]["embedding"], got[1].numpy(), atol=1e-5)
    r = _post(server, "/pooling", {"input": TEXTS[2]})
    assert r.status_code == 200 and r.json()["data"][0]["object"] == "pooling"
    assert np.allclose(r.json()["data"][0]["data"], got[2].numpy(), atol=1e-5)
    # an empty string is embedded as [CLS] [SEP] (sentence-transformers' vector), not refused
    r = _post(server, "/v1/embeddings", {"input": ["", TEXTS[0]]})
    assert r.status_code == 200, r.text
    empty = torch.tensor(r.json()["data"][0]["embedding"])
    want = reference_embeddings(bert_dir, [""], "MEAN", normalize=True)[0]
    assert F.cosine_similarity(empty, want, dim=0) >= 0.99999
    assert np.allclose(r.json()["data"][1]["embedding"], got[0].numpy(), atol=1e-5)


def test_score_and_rerank_are_cosine(server, ref):
    r = _post(server, "/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:4]})
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    assert scores == pytest.approx([float(ref[0] @ ref[i]) for i in (1, 2, 3)], abs=1e-5)
    r = _post(server, "/rerank", {"query": TEXTS[1], "documents": TEXTS, "top_n": 2})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    want = sorted(range(len(TEXTS)), key=lambda i: -float(ref[1] @ ref[i]))[:2]
    assert [x["index"] for x in results] == want
    assert results[0]["document"] == {"text": TEXTS[want[0]]}
    assert results[0]["relevance_score"] == pytest.approx(1.0, abs=1e-5)


def test_models_says_the_task_and_routes_need_the_key(server):
    cards = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert cards["data"][0]["task"] == "embed"
    for path, body in (("/v1/embeddings", {"input": "a"}), ("/score", {"text_1": "a", "text_2": "b"})):
        r = _post(server, path, body, key=None)
        assert r.status_code == 401


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/embeddings", {"input": "a cat", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"input": "a cat", "dimensions": 16}, "dimensions"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": " ".join(["cat"] * 80)}, "input"),
        ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 100}, "truncate_prompt_tokens"),
        ("/v1/embeddings", {"input": "a", "bogus": 1}, "bogus"),
        ("/v1/completions", {"prompt": "a cat", "max_tokens": 2}, "model"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "BadRequestError"


def test_truncation_keeps_the_last_tokens(server):
    r = _post(server, "/v1/embeddings", {"input": " ".join(["cat"] * 80), "truncate_prompt_tokens": 20})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 20


def test_generation_server_refuses_pooling_routes(tiny_llama_dir):
    with running_server(EngineArgs(model=str(tiny_llama_dir), num_gpu_blocks=32), "tiny-llama") as s:
        for path, body in (
            ("/v1/embeddings", {"input": "hello"}),
            ("/pooling", {"input": "hello"}),
            ("/score", {"text_1": "a", "text_2": "b"}),
            ("/rerank", {"query": "a", "documents": ["b"]}),
        ):
            r = httpx.post(s.url + path, json=body, timeout=30)
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["param"] == "model"
        assert httpx.get(s.url + "/v1/models").json()["data"][0]["task"] == "generate"


def test_online_bench_clients_against_the_server(server):
    import asyncio

    from kvserve.benchmarks.embed_online import run_clients

    texts = [TEXTS[i % len(TEXTS)] for i in range(24)]
    result = asyncio.run(run_clients(server.url, texts, concurrency=8, model=MODEL, api_key=API_KEY))
    assert (result["num_requests"], result["num_ok"], result["num_failed"]) == (24, 24, 0)
    assert result["prompt_tokens"] == sum(len(server.engine.tokenizer(t).input_ids) for t in texts)
    assert all(x is not None and x > 0 for x in result["latencies_ms"])
    assert result["latency_p50_ms"] <= result["latency_p99_ms"] <= result["latency_max_ms"]
    # without the key every request fails, and the run says so
    bad = asyncio.run(run_clients(server.url, texts[:4], concurrency=2, model=MODEL))
    assert bad["num_failed"] == 4 and "status 401" in bad["errors"][0]


def test_client_gone_stops_tokenizing_the_rest_of_its_batch(server, monkeypatch):
    import time

    from kvserve.entrypoints.openai import serving_pooling

    calls = []
    real = serving_pooling.encode_text

    def slow_encode(*args):  # each long text takes 0.1 s to tokenize
        calls.append(1)
        time.sleep(0.1)
        return real(*args)

    monkeypatch.setattr(serving_pooling, "encode_text", slow_encode)
    long_text = " ".join(["the"] * 2500)  # over the pool's inline size: tokenized on a thread
    body = {"input": [long_text] * 40, "truncate_prompt_tokens": 8}
    with pytest.raises(httpx.TimeoutException):
        _post(server, "/v1/embeddings", body, timeout=0.3)
    # wait for tokenizing to stop (it runs 4 s when the whole batch is tokenized)
    seen, still = -1, 0
    deadline = time.time() + 30
    while still < 10 and time.time() < deadline:
        time.sleep(0.1)
        still = still + 1 if len(calls) == seen else 0
        seen = len(calls)
    assert 1 <= len(calls) < 20, len(calls)
    server.wait_idle()
    r = _post(server, "/v1/embeddings", {"input": [long_text], "truncate_prompt_tokens": 8})
    assert r.status_code == 200 and len(r.json()["data"]) == 1
