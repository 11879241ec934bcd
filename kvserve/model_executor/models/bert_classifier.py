"""BERT with a sequence-classification head (``BertForSequenceClassification``): a cross-encoder.

A cross-encoder reads a pair of texts as one sequence (``[CLS] a [SEP] b [SEP]``, token types
0 then 1) and gives one relevance logit: BERT's pooler (a dense layer and tanh on the ``[CLS]``
hidden state) then the classifier (a dense layer to ``num_labels`` outputs), as transformers'
``BertForSequenceClassification`` computes it (dropout is off at inference). The score is that
logit through the activation sentence-transformers' ``CrossEncoder`` applies
(``layers.pooler.finish_score``). Checkpoint names beyond the encoder's: ``bert.pooler.dense``
and ``classifier``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model_executor.models.bert import BertModel


class BertForSequenceClassification(BertModel):
    """The encoder plus BERT's pooler and a classifier with one output.

    Args: as ``BertModel``.

    Raises:
        ValueError: as ``BertModel``; ``num_labels`` other than 1 (a score model has one
            output: the pair's relevance).
    """

    #: Serves the ``score`` task (pairs in, one relevance score out), not embeddings.
    is_cross_encoder = True
    #: only the masked-LM head is left unread: the pooler and the classifier are this model's
    skipped_prefixes = ("cls.", "embeddings.position_ids")

    def __init__(self, hf_config, dtype=torch.float32, device="cpu", max_position=None, tp=None):
        super().__init__(hf_config, dtype=dtype, device=device, max_position=max_position, tp=tp)
        labels = int(getattr(hf_config, "num_labels", 1))
        if labels != 1:
            raise ValueError(
                f"config.json: num_labels={labels}; a cross-encoder (score model) needs num_labels=1."
            )
        self.num_labels = labels
        H = self.hidden_size

        def p(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self._params.update(
            {
                "pooler.dense.weight": p(H, H),
                "pooler.dense.bias": p(H),
                "classifier.weight": p(labels, H),
                "classifier.bias": p(labels),
            }
        )
        self._register_params()

    def score_logits(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """The classifier's logits of each sequence: ``hidden`` ``[T, H]`` (``forward``'s
        output for sequences of ``seq_lens`` tokens, one after another) -> float32
        ``[len(seq_lens), num_labels]``, from each sequence's first (``[CLS]``) token."""
        P = self._params
        lens = torch.tensor(seq_lens, dtype=torch.int64, device=hidden.device)
        cls = hidden[torch.cumsum(lens, 0) - lens]
        pooled = torch.tanh(F.linear(cls, P["pooler.dense.weight"], P["pooler.dense.bias"]))
        return F.linear(pooled, P["classifier.weight"], P["classifier.bias"]).float()
