"""A tiny random BERT checkpoint on disk (transformers' ``BertConfig``, a word-level
``BertTokenizerFast`` over a small vocabulary) with sentence-transformers' module files, and a
tiny random cross-encoder (``BertForSequenceClassification`` with one label)."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = (
    "the a an of to and in is was it on for with as by at from that this be are were cat dog sat "
    "mat quick brown fox jumps over lazy sun rain city river tree house car road book paper "
    "music film food water fire earth sky night day red blue green one two three four five"
).split()

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a cat sat on the mat",
    "rain in the city",
    "one two three four five one two three four five the river and the tree",
    "music",
]


def tiny_bert_config(**overrides):
    """``BertConfig``: 2 layers, hidden 64, 4 heads, 64 positions, the ``WORDS`` vocabulary."""
    from transformers import BertConfig

    fields = dict(
        vocab_size=5 + len(WORDS),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        architectures=["BertModel"],
    )
    return BertConfig(**{**fields, **overrides})


def _save_tokenizer(path: Path) -> None:
    """The ``WORDS`` word-level BERT tokenizer (lowercasing, ``[CLS]`` / ``[SEP]`` pairs)."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    vocab = path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    wordpiece = BertWordPieceTokenizer(str(vocab), lowercase=True)
    BertTokenizerFast(
        tokenizer_object=wordpiece._tokenizer,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        mask_token="[MASK]",
    ).save_pretrained(path)


def save_tiny_cross_encoder(path: Path, seed: int = 0, **config) -> Path:
    """Write a random ``BertForSequenceClassification`` with ``num_labels=1`` (a cross-encoder,
    float32 safetensors; pooler and classifier included) and its tokenizer into ``path``."""
    import torch
    from transformers import BertForSequenceClassification

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    # initializer_range 0.3 (BERT's is 0.02) spreads the logits on both sides of 0, so the
    # sigmoid and the order of a rerank are both tested
    fields = dict(num_labels=1, architectures=["BertForSequenceClassification"], initializer_range=0.3)
    model = BertForSequenceClassification(tiny_bert_config(**{**fields, **config})).eval()
    model.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    return path


def reference_cross_scores(path: Path, pairs: list[tuple[str, str]]):
    """transformers' ``BertForSequenceClassification`` on each pair's tokenizer encoding (run
    alone, no padding): float32 ``[len(pairs)]`` ``sigmoid(logit)``."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(path)
    model = BertForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for a, b in pairs:
            out.append(torch.sigmoid(model(**tok(a, b, return_tensors="pt")).logits[0, 0]))
    return torch.stack(out)


def save_tiny_bert(
    path: Path,
    pooling: str | None = "MEAN",
    normalize: bool = True,
    max_seq_length: int | None = None,
    seed: int = 0,
    **config,
) -> Path:
    """Write a random ``BertModel`` (float32 safetensors), its tokenizer and, when ``pooling``
    is set, sentence-transformers' ``modules.json`` / ``1_Pooling/config.json`` (and a
    ``Normalize`` module when ``normalize``) into ``path``; returns ``path``."""
    import torch
    from transformers import BertModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = BertModel(tiny_bert_config(**config), add_pooling_layer=False).eval()
    model.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    if pooling is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        if normalize:
            modules.append(
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                }
            )
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(
            json.dumps(
                {
                    "word_embedding_dimension": int(model.config.hidden_size),
                    "pooling_mode_cls_token": pooling == "CLS",
                    "pooling_mode_mean_tokens": pooling == "MEAN",
                    "pooling_mode_max_tokens": False,
                    "pooling_mode_mean_sqrt_len_tokens": False,
                    "pooling_mode_lasttoken": pooling == "LAST",
                }
            )
        )
        if normalize:
            (path / "2_Normalize").mkdir(exist_ok=True)
        sb = {"do_lower_case": False}
        if max_seq_length is not None:
            sb["max_seq_length"] = max_seq_length
        (path / "sentence_bert_config.json").write_text(json.dumps(sb))
    return path


def reference_embeddings(path: Path, texts: list[str], pooling: str = "MEAN", normalize: bool = True):
    """transformers' ``BertModel`` hidden states pooled by hand (float32 ``[len(texts), H]``),
    each text run alone (no padding)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer, BertModel

    tok = AutoTokenizer.from_pretrained(path)
    model = BertModel.from_pretrained(path, add_pooling_layer=False, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for t in texts:
            enc = tok(t, return_tensors="pt")
            h = model(**enc).last_hidden_state[0]
            v = {"MEAN": h.mean(0), "CLS": h[0], "LAST": h[-1]}[pooling]
            out.append(F.normalize(v, dim=0) if normalize else v)
    return torch.stack(out)
