"""Facts read from a transformers config that more than one floor needs."""

from __future__ import annotations


def get_sliding_window(hf_config) -> int | None:
    """The attention window (tokens) that applies to *every* layer, or ``None``.

    Qwen2 configs carry a ``sliding_window`` they do not use unless ``use_sliding_window``;
    when only some layers slide (``layer_types``) the cache cannot drop old blocks, so this
    returns ``None`` and the model masks per layer.
    """
    w = getattr(hf_config, "sliding_window", None)
    if not w or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types and any(t != "sliding_attention" for t in layer_types):
        return None
    return int(w)
