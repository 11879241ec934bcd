"""The safetensors shards of a Hugging Face checkpoint directory (shared by the float and the
quantized-checkpoint loaders)."""

from __future__ import annotations

import json
from pathlib import Path


def shard_paths(model_dir: Path):
    """The safetensors shards of ``model_dir``: those its ``model.safetensors.index.json``
    names, else every ``*.safetensors``.

    Raises:
        ValueError: naming the index file: not JSON, no ``weight_map`` object of file names, or
            a shard it names that is not in the directory.
    """
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(model_dir.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise ValueError(f"{index} cannot be read as a JSON object: {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{index}: 'weight_map' must be an object of tensor name -> shard file name")
    paths = [model_dir / f for f in sorted(set(weight_map.values()))]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"{index} names shard(s) missing from {model_dir}: {', '.join(missing[:4])}")
    return paths
