"""Read a checkpoint's ``config.json`` into a transformers config and refuse values no model
could honour, naming the file and the field.

transformers accepts many impossible values silently (a negative rope base, a negative norm
epsilon, a key/value head count that does not divide the query heads, a window of 0) and some
fail only deep inside its modules or ours, with a message that names neither the file nor the
field; others it refuses with its own exception types, which are not ``ValueError``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

#: Size fields that must be integers >= 1 where a config has them (``None`` is left alone).
POSITIVE_INT_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "vocab_size",
    "max_position_embeddings",
    "intermediate_size",
    "head_dim",
)

#: Norm epsilons: finite numbers >= 0 (a negative one takes the root of a negative variance).
EPSILON_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")


def read_hf_config(model_dir):
    """The transformers config of ``model_dir`` (``AutoConfig``, local files only), checked by
    ``check_config_values``.

    Raises:
        ValueError: ``config.json`` is no JSON object, transformers refuses it (its own
            validation errors included), or a value is impossible; the message names
            ``config.json`` and, where one is to blame, the field.
    """
    from transformers import AutoConfig

    config_json = Path(model_dir) / "config.json"
    check_config_json(config_json)
    try:
        cfg = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers' strict-dataclass errors are no ValueError
        raise ValueError(f"{config_json}: transformers cannot read this config: {_one_line(e)}") from None
    check_config_values(cfg, str(config_json))
    return cfg


def check_config_json(path: Path) -> None:
    """Raises ValueError naming ``path`` when it is not a JSON object, or when its
    ``quantization_config`` is present but not an object (transformers would fail on it with
    an AttributeError deep inside, before any of our checks)."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    qc = cfg.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ValueError(
            f"{path}: quantization_config must be an object (with a quant_method), got "
            f"{type(qc).__name__} {json.dumps(qc)[:80]}"
        )


def check_config_values(cfg, where: str) -> None:
    """Refuse values of ``cfg`` (a transformers config read from ``where``) that no model can run.

    Checked where present: the sizes (``POSITIVE_INT_FIELDS``) are integers >= 1;
    ``num_attention_heads`` is a multiple of ``num_key_value_heads``; without a ``head_dim``,
    ``hidden_size`` is a multiple of ``num_attention_heads``; every rope base (``rope_theta``,
    per layer type too) and scaling ``factor`` is a finite number > 0, a
    ``partial_rotary_factor`` in (0, 1]; norm epsilons are finite and >= 0; a
    ``sliding_window`` that applies (not switched off by ``use_sliding_window``) is an integer
    >= 1; ``eos_token_id`` (one id or a list) lies in ``[0, vocab_size)``.

    Raises:
        ValueError: naming ``where`` and the field, its value and the limit.
    """
    for name in POSITIVE_INT_FIELDS:
        value = _field(cfg, name)
        if value is not None and not _is_int(value, low=1):
            raise ValueError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    heads = _field(cfg, "num_attention_heads")
    kv_heads = _field(cfg, "num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ValueError(
            f"{where}: num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads}"
        )
    hidden = _field(cfg, "hidden_size")
    if _field(cfg, "head_dim") is None and hidden is not None and heads is not None and hidden % heads:
        raise ValueError(
            f"{where}: hidden_size={hidden} must be a multiple of num_attention_heads={heads} "
            "(or the config must give head_dim)"
        )
    for name, value in _rope_bases(cfg):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{where}: {name} must be a finite number > 0, got {value!r}")
    for name, value in _rope_fields(cfg, "factor"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{where}: {name} must be a finite number > 0, got {value!r}")
    for name, value in _rope_fields(cfg, "partial_rotary_factor"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"{where}: {name} must be a number in (0, 1], got {value!r}")
    for name in EPSILON_FIELDS:
        value = _field(cfg, name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf
        ):
            raise ValueError(f"{where}: {name} must be a finite number >= 0, got {value!r}")
    window = _field(cfg, "sliding_window")
    if window is not None and _field(cfg, "use_sliding_window") is not False and not _is_int(window, low=1):
        raise ValueError(
            f"{where}: sliding_window must be an integer >= 1 (or null for no window), got {window!r}"
        )
    vocab = _field(cfg, "vocab_size")
    eos = _field(cfg, "eos_token_id")
    for token in eos if isinstance(eos, list) else [eos]:
        if token is not None and vocab is not None and not (_is_int(token, low=0) and token < vocab):
            raise ValueError(f"{where}: eos_token_id {token!r} must be an integer in [0, vocab_size={vocab})")


def context_length(cfg, model_dir) -> int:
    """The model's ``max_position_embeddings`` (the bound of ``max_model_len``).

    Raises:
        ValueError: the config has none (e.g. a multimodal config holding it in its
            ``text_config``, or a model without position limits such as ALiBi or state-space
            ones), naming ``model_dir``'s ``config.json``.
    """
    value = _field(cfg, "max_position_embeddings")
    if value is None:
        kind = getattr(cfg, "model_type", None)
        raise ValueError(
            f"{Path(model_dir) / 'config.json'}: no max_position_embeddings (model_type {kind!r}); "
            "kvserve needs the model's context length to bound max_model_len"
        )
    return int(value)


def _field(cfg, name: str) -> Any:
    try:
        return getattr(cfg, name, None)
    except Exception:  # a config property computed from other (bad) fields
        return None


def _is_int(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _rope_bases(cfg) -> list[tuple[str, Any]]:
    """``(field name, value)`` of every rope base the config names: ``rope_theta``,
    ``rope_local_base_freq`` and the ``rope_theta`` of ``rope_parameters``."""
    found = [(n, _field(cfg, n)) for n in ("rope_theta", "rope_local_base_freq")]
    return [(n, v) for n, v in found if v is not None] + _rope_fields(cfg, "rope_theta")


def _rope_fields(cfg, key: str) -> list[tuple[str, Any]]:
    """``(field name, value)`` of ``key`` in ``rope_parameters`` (flat, or one dict per layer
    type as Gemma 3's) and, for ``partial_rotary_factor``, the config's own field."""
    found = [(key, _field(cfg, key))] if key == "partial_rotary_factor" else []
    params = _field(cfg, "rope_parameters")
    if isinstance(params, dict):
        if key in params:
            found.append((f"rope_parameters.{key}", params[key]))
        for name, sub in params.items():
            if isinstance(sub, dict) and key in sub:
                found.append((f"rope_parameters.{name}.{key}", sub[key]))
    return [(n, v) for n, v in found if v is not None]


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 400 else text[:400] + " ..."
