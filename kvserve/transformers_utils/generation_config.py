"""Default sampling parameters from a model's ``generation_config.json``.

A request that leaves a sampling field out takes the model's own default for it, as vLLM does
with ``--generation-config auto``: the keys read are ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``). Other keys
(``do_sample``, ``num_beams``, ...) are not read, as in vLLM.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

#: generation_config.json key -> SamplingParams field
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}

#: ``generation_config`` values that are not a directory: ``auto`` reads the model's own file,
#: ``vllm`` reads none (kvserve's own defaults).
GENERATION_CONFIG_AUTO = "auto"
GENERATION_CONFIG_OFF = "vllm"


def _check_value(path: str, key: str, value: Any) -> Any:
    """``value`` of ``key`` in ``path`` as its SamplingParams field takes it.

    Raises:
        ValueError: not a number (or not an integer for ``top_k`` / ``max_new_tokens``), naming
            the file and the key.
    """
    integer = key in ("top_k", "max_new_tokens", "max_tokens")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if integer:
        ok = ok and float(value).is_integer()
    if not ok:
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{path}: {key} must be {kind}, got {value!r}.")
    return int(value) if integer else float(value)


def read_generation_defaults(path: str) -> dict[str, Any]:
    """The SamplingParams defaults in the ``generation_config.json`` at ``path`` (keys of
    ``GENERATION_CONFIG_KEYS`` present in it, renamed to SamplingParams fields; ``top_k`` 0
    (transformers' "off") as -1, kvserve's "off").

    Raises:
        ValueError: the file is not a JSON object, or a value has the wrong type (naming the
            file and the key). Ranges are checked by ``SamplingParams`` (``generation_defaults``).
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}).") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must be a JSON object, got {type(data).__name__}.")
    out: dict[str, Any] = {}
    for key, field in GENERATION_CONFIG_KEYS.items():
        if data.get(key) is None:
            continue
        out[field] = _check_value(path, key, data[key])
    if out.get("top_k") == 0:
        out["top_k"] = -1
    return out


def generation_defaults(
    setting: str, model_dir: str | os.PathLike | None, overrides: dict[str, Any] | None = None
) -> tuple[dict[str, Any], str | None]:
    """``(defaults, source)``: the sampling defaults in force and the file they came from.

    Args:
        setting: ``"auto"`` (the ``generation_config.json`` in ``model_dir``, none if it has
            none), ``"vllm"`` (none: kvserve's own defaults), or a directory holding a
            ``generation_config.json``.
        model_dir: the model's directory (None: no file for ``"auto"``).
        overrides: SamplingParams fields (or ``max_new_tokens``) set over the file's
            (``override_generation_config``).

    Raises:
        ValueError: a directory without ``generation_config.json``, a bad file, or a default out
            of ``SamplingParams``' range, naming ``generation_config`` / the file and the field.
    """
    from kvserve.sampling_params import SamplingParams

    path: str | None = None
    if setting == GENERATION_CONFIG_AUTO:
        if model_dir is not None:
            candidate = os.path.join(os.fspath(model_dir), "generation_config.json")
            path = candidate if os.path.isfile(candidate) else None
    elif setting != GENERATION_CONFIG_OFF:
        candidate = os.path.join(os.path.expanduser(setting), "generation_config.json")
        if not os.path.isfile(candidate):
            raise ValueError(
                f"generation_config={setting!r}: no generation_config.json there (give 'auto', "
                "'vllm' or a directory that holds one)."
            )
        path = candidate
    defaults = read_generation_defaults(path) if path is not None else {}
    for key, value in (overrides or {}).items():
        field = GENERATION_CONFIG_KEYS.get(key, key)
        if field not in GENERATION_CONFIG_KEYS.values():
            raise ValueError(
                f"override_generation_config: {key!r} is not one of {sorted(GENERATION_CONFIG_KEYS)}."
            )
        defaults[field] = _check_value("override_generation_config", key, value)
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{path or 'override_generation_config'}: {e}") from None
    return defaults, path
