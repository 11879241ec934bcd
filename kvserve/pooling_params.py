"""Per-request parameters of a pooling request (embeddings, scores)."""

from __future__ import annotations

from dataclasses import dataclass

#: Pooling tasks a request may ask for: ``embed`` (one vector per input), ``encode`` (the same
#: vector, the ``/pooling`` route's name for it), ``score`` (a cross-encoder's relevance score
#: of one text pair encoded as one sequence).
POOLING_TASKS = ("embed", "encode", "score")


@dataclass
class PoolingParams:
    """What a pooling request returns.

    Attributes:
        dimensions: keep the first ``dimensions`` components of the embedding (Matryoshka
            truncation; the model must declare it, see ``PoolerConfig.matryoshka_dimensions``),
            renormalised when the model normalises; None = the full vector.
        normalize: L2-normalise the vector (None = the model's pooler setting).
        truncate_prompt_tokens: keep only the last ``k`` tokens of an over-long prompt
            (``-1`` = the model's length); None = an over-long prompt is refused.
        task: one of ``POOLING_TASKS``.
        token_type_ids: the segment of each prompt token (BERT's ``token_type_ids``: 0 for
            ``[CLS] a [SEP]``, 1 for ``b [SEP]`` of a pair); None: all 0. Only the engine sets
            it, from a prompt dict's ``token_type_ids`` (``LLM.score`` and ``/score`` on a
            cross-encoder pass the tokenizer's pair encoding); a request that sets it is
            refused.

    Raises:
        ValueError: (in ``verify``) a field out of range, naming it.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str = "embed"
    token_type_ids: list[int] | None = None

    def verify(self) -> None:
        """Check the fields' ranges; raises ValueError naming the field."""
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}.")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}.")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {t!r}.")
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}; got {self.task!r}.")
