"""Poolers: one vector per sequence from a model's final hidden states.

``PoolerConfig`` comes from the checkpoint's sentence-transformers files when it has them
(``modules.json`` naming a ``Pooling`` module and its ``config.json``, a ``Normalize`` module,
``sentence_bert_config.json``'s ``max_seq_length``), else from vLLM's defaults: ``CLS`` for an
encoder, ``LAST`` for a decoder converted to embeddings, normalised either way. A
cross-encoder (a classification head on an encoder) has a fixed pooler, its head on ``[CLS]``,
and the ``score`` task: its output goes through ``finish_score``, never normalised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

#: Pooling types, by vLLM's names.
POOLING_TYPES = ("MEAN", "CLS", "LAST")

#: What a pooling model serves: ``embed`` (a vector per input) or ``score`` (a cross-encoder:
#: one relevance score per text pair).
MODEL_TASKS = ("embed", "score")

#: The activations a cross-encoder's logit may go through, by the names sentence-transformers
#: writes in ``config.json`` (``sentence_transformers.activation_fn``).
SCORE_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.Identity": "identity",
}


@dataclass
class PoolerConfig:
    """How hidden states become one vector.

    Attributes:
        pooling_type: ``MEAN`` (average over the sequence's tokens), ``CLS`` (its first
            token), ``LAST`` (its last token).
        normalize: L2-normalise the vector.
        max_seq_length: the longest input the model was trained for (sentence-transformers'
            ``max_seq_length``), or None.
        matryoshka_dimensions: dimensions the vector may be truncated to (``dimensions`` of a
            request), from ``config.json``'s ``matryoshka_dimensions`` (or every size up to
            the hidden size when it says ``is_matryoshka``); None: no truncation.
        task: one of ``MODEL_TASKS``.
        score_activation: a ``score`` model's activation on its logit: ``sigmoid`` or
            ``identity`` (see ``score_activation``); None for an ``embed`` model.
    """

    pooling_type: str
    normalize: bool = True
    max_seq_length: int | None = None
    matryoshka_dimensions: list[int] | None = None
    task: str = "embed"
    score_activation: str | None = None

    def __post_init__(self) -> None:
        self.pooling_type = str(self.pooling_type).upper()
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {self.pooling_type!r}."
            )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, (dict, list)):
        raise ValueError(f"{path}: expected a JSON object or list")
    return data  # type: ignore[return-value]


def _st_pooling_type(path: Path) -> str:
    """The pooling type a sentence-transformers ``Pooling`` config names (exactly one mode)."""
    cfg = _read_json(path)
    modes = {
        "pooling_mode_mean_tokens": "MEAN",
        "pooling_mode_cls_token": "CLS",
        "pooling_mode_lasttoken": "LAST",
    }
    unsupported = (
        "pooling_mode_max_tokens",
        "pooling_mode_mean_sqrt_len_tokens",
        "pooling_mode_weightedmean_tokens",
    )
    on = [k for k in modes if cfg.get(k)]
    off_list = [k for k in unsupported if cfg.get(k)]
    if off_list or len(on) != 1:
        raise ValueError(
            f"{path}: supported pooling is exactly one of {', '.join(modes)}; "
            f"it sets {', '.join(on + off_list) or 'none'}"
        )
    return modes[on[0]]


def score_activation(hf_config) -> str:
    """The activation sentence-transformers' ``CrossEncoder`` (6.x) applies to a one-output
    model's logit: the one ``config.json`` names under ``sentence_transformers.activation_fn``,
    else ``sigmoid`` (its default for ``num_labels == 1``).

    Raises:
        ValueError: an activation other than those of ``SCORE_ACTIVATIONS``, naming the field.
    """
    st = getattr(hf_config, "sentence_transformers", None)
    name = st.get("activation_fn") if isinstance(st, dict) else None
    if name is None:
        return "sigmoid"
    if name not in SCORE_ACTIVATIONS:
        raise ValueError(
            f"config.json: sentence_transformers.activation_fn={name!r}; supported: "
            f"{', '.join(SCORE_ACTIVATIONS)}."
        )
    return SCORE_ACTIVATIONS[name]


def read_pooler_config(
    model_dir: Path,
    hf_config,
    is_encoder: bool,
    override: dict | None = None,
    cross_encoder: bool = False,
) -> PoolerConfig:
    """The checkpoint's ``PoolerConfig`` (see the module doc), then ``override``'s fields
    (``pooling_type``, ``normalize``: the ``--pooler-config`` JSON) over it. A
    ``cross_encoder`` gets the ``score`` task, ``CLS`` pooling and no normalisation.

    Raises:
        ValueError: an unreadable sentence-transformers file, an unsupported pooling mode, an
            unknown override key, any override on a cross-encoder, an unsupported score
            activation (each naming the file or key).
    """
    model_dir = Path(model_dir)
    if cross_encoder:
        if override:
            raise ValueError(
                f"pooler_config ({', '.join(override)}) does not apply to a cross-encoder: its "
                "classification head reads the [CLS] token and its score is not normalised."
            )
        return PoolerConfig(
            "CLS", normalize=False, task="score", score_activation=score_activation(hf_config)
        )
    pooling_type = "CLS" if is_encoder else "LAST"
    normalize = True
    max_seq_length = None
    modules_path = model_dir / "modules.json"
    if modules_path.is_file():
        modules = _read_json(modules_path)
        if not isinstance(modules, list):
            raise ValueError(f"{modules_path}: expected a list of modules")
        types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
        pool = next(
            (m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")), None
        )
        if pool is not None:
            pooling_type = _st_pooling_type(model_dir / str(pool.get("path", "")) / "config.json")
        normalize = any(t.endswith(".Normalize") for t in types)
        sbert = model_dir / "sentence_bert_config.json"
        if sbert.is_file():
            msl = _read_json(sbert).get("max_seq_length")
            max_seq_length = int(msl) if isinstance(msl, int) and msl > 0 else None
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims is not None:
        matryoshka = sorted({int(d) for d in dims})
    elif getattr(hf_config, "is_matryoshka", False):
        matryoshka = list(range(1, int(hf_config.hidden_size) + 1))
    else:
        matryoshka = None
    cfg = PoolerConfig(pooling_type, normalize, max_seq_length, matryoshka)
    for key, value in (override or {}).items():
        if key == "pooling_type":
            cfg = PoolerConfig(str(value), cfg.normalize, max_seq_length, matryoshka)
        elif key == "normalize":
            if not isinstance(value, bool):
                raise ValueError(f"pooler_config.normalize must be a boolean, got {value!r}.")
            cfg.normalize = value
        else:
            raise ValueError(f"pooler_config has unknown key {key!r}; known: pooling_type, normalize.")
    return cfg


def pool(hidden: torch.Tensor, seq_lens: list[int], pooling_type: str) -> torch.Tensor:
    """One vector per sequence.

    Args:
        hidden: ``[T, H]`` the sequences' final hidden states one after another (``T`` =
            ``sum(seq_lens)``).
        seq_lens: tokens of each sequence, each >= 1.
        pooling_type: one of ``POOLING_TYPES``.
    Returns:
        float32 ``[len(seq_lens), H]``.
    """
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=hidden.device)
    ends = torch.cumsum(lens, 0)
    starts = ends - lens
    if pooling_type == "CLS":
        return hidden[starts].float()
    if pooling_type == "LAST":
        return hidden[ends - 1].float()
    # MEAN: one reduction per sequence's slice (a few times faster on CPU than a segment sum
    # by index_add_ over all tokens, whose row-index scatter runs serially)
    return torch.stack([t.mean(0) for t in torch.split(hidden.float(), seq_lens)])


def finish_vector(vec: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """A pooled float32 vector ``[H]`` truncated to its first ``dimensions`` components (None:
    all), then L2-normalised when ``normalize``."""
    if dimensions is not None:
        vec = vec[:dimensions]
    if normalize:
        vec = F.normalize(vec, p=2, dim=-1)
    return vec.contiguous()


def finish_score(logits: torch.Tensor, activation: str | None) -> torch.Tensor:
    """A cross-encoder's float32 logits ``[num_labels]`` through its activation (``sigmoid`` or
    ``identity``, ``PoolerConfig.score_activation``)."""
    return torch.sigmoid(logits) if activation == "sigmoid" else logits
