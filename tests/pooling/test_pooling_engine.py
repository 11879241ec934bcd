"""Pooling models on the engine: embeddings equal transformers' hidden states pooled the same
way, blocks are freed in the step, and bad input is refused by field."""

import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM
from kvserve.pooling_params import PoolingParams
from tests.pooling.tiny_bert import TEXTS, reference_embeddings, save_tiny_bert

COSINE = 0.99999


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), pooling="MEAN", normalize=True)


@pytest.fixture(scope="module")
def bert_llm(bert_dir):
    llm = LLM(model=str(bert_dir))
    yield llm
    llm.shutdown()


def _vecs(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


def test_bert_mean_pooling_matches_transformers_single_and_batched(bert_llm, bert_dir):
    ref = reference_embeddings(bert_dir, TEXTS, "MEAN", normalize=True)
    assert bert_llm.llm_engine.runner == "pooling"
    single = _vecs(bert_llm.embed(TEXTS[0]))
    assert single.shape == (1, 64)
    assert F.cosine_similarity(single, ref[:1]).min() >= COSINE
    batched = _vecs(bert_llm.embed(TEXTS))
    assert F.cosine_similarity(batched, ref).min() >= COSINE
    assert torch.allclose(batched.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
    # the same text alone and inside a batch of other lengths: the same vector
    assert torch.allclose(single[0], batched[0], atol=1e-5)


def test_torch_attention_path_matches_transformers_too(bert_llm, bert_dir, monkeypatch):
    """Where the native encoder attention does not run (CUDA, no compiler), the padded SDPA
    groups give the same vectors."""
    from kvserve.ops import encoder_attention

    monkeypatch.setattr(encoder_attention, "supports", lambda *a: False)
    ref = reference_embeddings(bert_dir, TEXTS, "MEAN", normalize=True)
    assert F.cosine_similarity(_vecs(bert_llm.embed(TEXTS)), ref).min() >= COSINE


def test_pooling_keeps_no_blocks(bert_llm):
    engine = bert_llm.llm_engine
    bert_llm.embed(TEXTS * 20)
    stats = engine.get_kv_cache_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert stats["num_swapped_out_blocks"] == 0 and stats["num_preemptions"] == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.scheduler.swapped
    assert not engine.has_unfinished_requests()


def test_score_is_cosine_of_embeddings(bert_llm, bert_dir):
    ref = reference_embeddings(bert_dir, TEXTS, "MEAN", normalize=True)
    outs = bert_llm.score(TEXTS[1], TEXTS)
    want = F.cosine_similarity(ref[1:2].expand(len(TEXTS), -1), ref)
    got = torch.tensor([o.outputs.score for o in outs])
    assert torch.allclose(got, want, atol=1e-5)
    assert got[1] == pytest.approx(1.0, abs=1e-5)
    pair = bert_llm.score([TEXTS[0], TEXTS[2]], [TEXTS[3], TEXTS[4]])
    assert [o.outputs.score for o in pair] == pytest.approx(
        [float(ref[0] @ ref[3]), float(ref[2] @ ref[4])], abs=1e-5
    )
    with pytest.raises(ValueError, match="text_1 has 2 texts"):
        bert_llm.score(TEXTS[:2], TEXTS[:3])


def test_score_truncates_each_text_like_the_score_route(bert_llm, bert_dir):
    from transformers import AutoTokenizer, BertModel

    tok = AutoTokenizer.from_pretrained(bert_dir)
    model = BertModel.from_pretrained(bert_dir, add_pooling_layer=False, dtype=torch.float32).eval()
    k = 6
    with torch.no_grad():  # each text's last k tokens, mean-pooled and normalised
        ref = [
            F.normalize(model(torch.tensor([tok(t).input_ids[-k:]])).last_hidden_state[0].mean(0), dim=0)
            for t in (TEXTS[0], TEXTS[3])
        ]
    outs = bert_llm.score(TEXTS[0], [TEXTS[3]], truncate_prompt_tokens=k)
    assert outs[0].outputs.score == pytest.approx(float(ref[0] @ ref[1]), abs=1e-5)
    assert len(outs[0].prompt_token_ids) == 2 * k
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        bert_llm.score(TEXTS[0], [TEXTS[3]], truncate_prompt_tokens=0)


def test_empty_text_embeds_the_tokens_the_tokenizer_adds(bert_llm, bert_dir):
    """sentence-transformers embeds "" as [CLS] [SEP]; so does the engine, alone and in a batch."""
    ref = reference_embeddings(bert_dir, ["", TEXTS[0]], "MEAN", normalize=True)
    outs = bert_llm.embed(["", TEXTS[0]])
    assert outs[0].prompt_token_ids == bert_llm.get_tokenizer()("").input_ids
    assert len(outs[0].prompt_token_ids) == 2
    assert F.cosine_similarity(_vecs(outs), ref).min() >= COSINE


def test_bad_pooling_input_is_refused_by_field(bert_llm):
    with pytest.raises(ValueError, match="pooling model"):
        bert_llm.generate(["the cat"])
    with pytest.raises(ValueError, match="dimensions=8: this model does not support Matryoshka"):
        bert_llm.embed(TEXTS[0], PoolingParams(dimensions=8))
    long_text = " ".join(["cat"] * 100)
    with pytest.raises(ValueError, match="input has 102 tokens > max_model_len 64"):
        bert_llm.embed(long_text)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bert_llm.embed([[2, 10_000, 3]])
    # truncation keeps the last tokens
    cut = bert_llm.encode(long_text, PoolingParams(truncate_prompt_tokens=10))
    assert len(cut[0].prompt_token_ids) == 10
    assert not bert_llm.llm_engine.has_unfinished_requests()


def test_cls_pooling_without_normalize_and_matryoshka(tmp_path, caplog):
    path = save_tiny_bert(
        tmp_path / "cls", pooling="CLS", normalize=False, matryoshka_dimensions=[16, 32, 64]
    )
    ref = reference_embeddings(path, TEXTS, "CLS", normalize=False)
    with caplog.at_level("INFO", logger="kvserve"):
        llm = LLM(model=str(path))
    assert "default sampling parameters" not in caplog.text  # a pooling model samples nothing
    try:
        got = _vecs(llm.embed(TEXTS))
        assert torch.allclose(got, ref, atol=1e-5)
        cut = _vecs(llm.embed(TEXTS, PoolingParams(dimensions=16)))
        assert cut.shape == (len(TEXTS), 16)
        assert torch.allclose(cut, ref[:, :16], atol=1e-5)
        normed = _vecs(llm.embed(TEXTS, PoolingParams(dimensions=32, normalize=True)))
        assert torch.allclose(normed, F.normalize(ref[:, :32], dim=1), atol=1e-5)
        with pytest.raises(
            ValueError, match="dimensions=20 is not supported by this model; supported: 16, 32, 64"
        ):
            llm.embed(TEXTS[0], PoolingParams(dimensions=20))
    finally:
        llm.shutdown()


def test_runner_settings_refused(bert_dir):
    with pytest.raises(ValueError, match="encoder-only"):
        LLM(model=str(bert_dir), runner="generate")
    with pytest.raises(ValueError, match="enable_prefix_caching=True is not supported with runner='pooling'"):
        LLM(model=str(bert_dir), enable_prefix_caching=True)
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(model=str(bert_dir), runner="score")
    with pytest.raises(ValueError, match="pooler_config has unknown key 'pool'"):
        LLM(model=str(bert_dir), pooler_config={"pool": "MEAN"})


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_decoder_convert_embed_matches_transformers(tiny_llama_dir, tiny_hf_model, pooling_type):
    llm = LLM(
        model=str(tiny_llama_dir),
        convert="embed",
        pooler_config={"pooling_type": pooling_type},
        dtype="float32",
    )
    try:
        prompts = [[1, 5, 9, 200, 31], [1, 7, 8], [1, 300, 301, 302, 303, 304, 305, 306, 307]]
        got = _vecs(llm.embed([{"prompt_token_ids": p} for p in prompts]))
        for p, g in zip(prompts, got):
            with torch.no_grad():
                h = tiny_hf_model.model(torch.tensor([p], device=tiny_hf_model.device)).last_hidden_state[0]
            v = h[-1] if pooling_type == "LAST" else h.mean(0)
            assert torch.allclose(g, F.normalize(v.float().cpu(), dim=0), atol=1e-5)
        with pytest.raises(ValueError, match="pooling model"):
            llm.generate([[1, 5, 9]])
    finally:
        llm.shutdown()


def test_generation_model_refuses_pooling(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), num_gpu_blocks=64)
    try:
        assert llm.llm_engine.runner == "generate"
        with pytest.raises(ValueError, match="generation model: it takes no pooling"):
            llm.embed("hello")
    finally:
        llm.shutdown()
