"""A cross-encoder (``BertForSequenceClassification``, one label) as a score model: each pair
read as one sequence, its score equal to transformers' ``sigmoid(logit)`` and to
sentence-transformers' ``CrossEncoder.predict``, offline and through ``/score`` and
``/rerank``; embeddings refused by name."""

import httpx
import pytest
import torch

from kvserve import LLM
from kvserve.config import EngineArgs
from kvserve.pooling_params import PoolingParams
from tests.pooling.tiny_bert import TEXTS, reference_cross_scores, save_tiny_cross_encoder
from tests.server_harness import running_server

MODEL = "tiny-ce"
QUERY = TEXTS[0]
#: pairs of every length mix, both orders of one pair (the token types make them differ)
PAIRS = [(QUERY, t) for t in TEXTS] + [(TEXTS[3], TEXTS[1]), (TEXTS[1], TEXTS[3])]


@pytest.fixture(scope="module")
def ce_dir(tmp_path_factory):
    return save_tiny_cross_encoder(tmp_path_factory.mktemp("tiny-ce"))


@pytest.fixture(scope="module")
def ref(ce_dir):
    return reference_cross_scores(ce_dir, PAIRS)


@pytest.fixture(scope="module")
def ce_llm(ce_dir):
    llm = LLM(model=str(ce_dir))
    yield llm
    llm.shutdown()


def _scores(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.score for o in outs])


def test_scores_match_transformers_pairwise_and_one_against_many(ce_llm, ref):
    pooler = ce_llm.llm_engine.pooler_config
    assert (pooler.task, pooler.score_activation) == ("score", "sigmoid")
    got = _scores(ce_llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS]))
    assert torch.allclose(got, ref, atol=1e-5), (got, ref)
    assert float(ref.max() - ref.min()) > 0.2  # the model separates the pairs
    many = _scores(ce_llm.score(QUERY, TEXTS))
    assert torch.allclose(many, ref[: len(TEXTS)], atol=1e-5)
    # the pair is one sequence: [CLS] a [SEP] b [SEP]
    tok = ce_llm.llm_engine.tokenizer
    out = ce_llm.score(TEXTS[1], TEXTS[2])[0]
    assert out.prompt_token_ids == tok(TEXTS[1], TEXTS[2]).input_ids


def test_scores_match_sentence_transformers_cross_encoder(ce_llm, ce_dir):
    st = pytest.importorskip("sentence_transformers")
    ce = st.CrossEncoder(str(ce_dir), device="cpu")
    assert isinstance(ce.activation_fn, torch.nn.Sigmoid)  # its default for one label
    want = torch.tensor(ce.predict(PAIRS))
    got = _scores(ce_llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS]))
    assert torch.allclose(got, want, atol=1e-5), (got, want)


def test_truncation_shortens_the_longer_text_first(ce_llm, ce_dir):
    long_text = " ".join(["river"] * 70)  # 70 tokens: the pair is over max_model_len (64)
    with pytest.raises(ValueError, match="max_model_len"):
        ce_llm.score(QUERY, long_text)
    got = ce_llm.score(QUERY, long_text, truncate_prompt_tokens=24)[0]
    from transformers import AutoTokenizer, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(ce_dir)
    enc = tok(QUERY, long_text, truncation="longest_first", max_length=24, return_tensors="pt")
    assert got.prompt_token_ids == enc.input_ids[0].tolist()
    model = BertForSequenceClassification.from_pretrained(ce_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = float(torch.sigmoid(model(**enc).logits[0, 0]))
    assert got.outputs.score == pytest.approx(want, abs=1e-5)


def test_embeddings_and_bad_fields_are_refused_by_name(ce_llm):
    with pytest.raises(ValueError, match="cross-encoder"):
        ce_llm.embed(TEXTS[0])
    with pytest.raises(ValueError, match="normalize"):
        ce_llm.encode(TEXTS[0], PoolingParams(task="score", normalize=True))
    with pytest.raises(ValueError, match="text_1"):
        ce_llm.score([[5, 6, 7]], TEXTS[0])
    with pytest.raises(ValueError, match="token_type_ids"):
        ce_llm.encode(
            {"prompt_token_ids": [2, 7, 3], "token_type_ids": [0, 5, 1]}, PoolingParams(task="score")
        )
    with pytest.raises(ValueError, match="prompt dict"):
        ce_llm.encode([2, 7, 3], PoolingParams(task="score", token_type_ids=[0, 0, 1]))


def test_embedding_model_refuses_the_score_task(tmp_path):
    from tests.pooling.tiny_bert import save_tiny_bert

    llm = LLM(model=str(save_tiny_bert(tmp_path / "bert")))
    try:
        with pytest.raises(ValueError, match="cross-encoder"):
            llm.encode(TEXTS[0], PoolingParams(task="score"))
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(ce_dir):
    with running_server(EngineArgs(model=str(ce_dir)), MODEL) as s:
        yield s


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def _pair_tokens(server, a, b) -> int:
    return len(server.engine.tokenizer(a, b).input_ids)


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_route(server, ref, path):
    r = _post(server, path, {"model": MODEL, "text_1": QUERY, "text_2": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    assert [d["score"] for d in body["data"]] == pytest.approx(ref[: len(TEXTS)].tolist(), abs=1e-5)
    n = sum(_pair_tokens(server, QUERY, t) for t in TEXTS)
    assert body["usage"] == {
        "prompt_tokens": n,
        "completion_tokens": 0,
        "total_tokens": n,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    pairs = PAIRS[len(TEXTS) :]
    r = _post(server, path, {"text_1": [a for a, _ in pairs], "text_2": [b for _, b in pairs]})
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(ref[len(TEXTS) :].tolist(), abs=1e-5)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
def test_rerank_route_orders_by_score(server, ref, path):
    want = sorted(range(len(TEXTS)), key=lambda i: -float(ref[i]))
    r = _post(server, path, {"query": QUERY, "documents": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [x["index"] for x in body["results"]] == want
    assert [x["relevance_score"] for x in body["results"]] == pytest.approx(
        [float(ref[i]) for i in want], abs=1e-5
    )
    assert body["results"][0]["document"] == {"text": TEXTS[want[0]]}
    n = sum(_pair_tokens(server, QUERY, t) for t in TEXTS)
    assert body["usage"]["prompt_tokens"] == n
    r = _post(server, path, {"query": QUERY, "documents": TEXTS, "top_n": 2, "return_documents": False})
    results = r.json()["results"]
    assert [x["index"] for x in results] == want[:2]
    assert all(x["document"] is None for x in results)


def test_models_says_score_and_embeddings_are_a_400_naming_model(server):
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["task"] == "score"
    for path in ("/v1/embeddings", "/pooling"):
        r = _post(server, path, {"input": "a cat"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "model"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/score", {"text_1": QUERY, "text_2": " ".join(["cat"] * 70)}, "text_2"),
        ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 100}, "truncate_prompt_tokens"),
        ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("/rerank", {"query": QUERY, "documents": [" ".join(["cat"] * 70)]}, "documents"),
        ("/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
        # an empty side of the pair is named by the route's own field, not the pair's
        ("/score", {"text_1": "", "text_2": "b"}, "text_1"),
        ("/score", {"text_1": "a", "text_2": ["b", ""]}, "text_2"),
        ("/rerank", {"query": "", "documents": ["a"]}, "query"),
        ("/rerank", {"query": QUERY, "documents": ["a", ""]}, "documents"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"].startswith(param) or "text_" not in err["message"], err


def test_truncated_pair_over_the_server(server):
    body = {"text_1": QUERY, "text_2": " ".join(["cat"] * 70), "truncate_prompt_tokens": -1}
    r = _post(server, "/score", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 64
