"""``--lora-modules NAME=PATH`` entries (``kvserve serve`` and ``kvserve generate``): parsing
only, no server or engine imports."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from kvserve.field_limits import LORA_NAME_RULE, lora_name_ok


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: the public ``name``, the PEFT directory ``path`` and,
    optionally, the ``base_model_name`` reported as its ``parent`` (default: the served name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """``name=path`` or vLLM's JSON form ``{"name", "path", "base_model_name"?}``.

    Raises:
        argparse.ArgumentTypeError: neither form, an empty name or path, or unknown JSON keys
            (argparse reports it naming ``--lora-modules``).
    """
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
        if not isinstance(obj, dict):
            raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
        unknown = sorted(set(obj) - {"name", "path", "base_model_name"})
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown key(s) {unknown} in {text!r} (allowed: name, path, base_model_name)"
            )
        name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
        if base is not None and (not isinstance(base, str) or not base):
            raise argparse.ArgumentTypeError(f"base_model_name must be a non-empty string in {text!r}")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {text!r}")
        base = None
    if not isinstance(name, str) or not name.strip():
        raise argparse.ArgumentTypeError(f"the adapter name is empty in {text!r}")
    if not lora_name_ok(name.strip()):
        raise argparse.ArgumentTypeError(f"the adapter name must be {LORA_NAME_RULE}, in {text!r}")
    if not isinstance(path, str) or not path.strip():
        raise argparse.ArgumentTypeError(f"the adapter path is empty in {text!r}")
    return LoRAModulePath(name.strip(), path.strip(), base)
