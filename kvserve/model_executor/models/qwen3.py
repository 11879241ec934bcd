"""Qwen3 (``Qwen3ForCausalLM``) on the decoder skeleton of ``models.llama``.

Its parts beyond Llama's: an RMSNorm of ``head_dim`` weights on every q and k head before rotary
(``self_attn.q_norm`` / ``k_norm``), a ``head_dim`` of its own (often not hidden / heads), no
q/k/v bias unless ``attention_bias``. Pure-decode CPU steps run on ``cpu_decode_step`` as
Llama's do, the q/k norms there by the same RMSNorm kernel as the module path's.
"""

from __future__ import annotations

from kvserve.model_executor.models.llama import DecoderParts, LlamaForCausalLM


def check_uniform_attention(hf_config, family: str) -> None:
    """Raises ValueError when ``hf_config`` slides the attention window on some layers only
    (``use_sliding_window`` with mixed ``layer_types``): the skeleton applies one window to all
    layers or none."""
    if getattr(hf_config, "use_sliding_window", False) and getattr(hf_config, "sliding_window", None):
        types = set(getattr(hf_config, "layer_types", None) or [])
        if len(types) > 1:
            raise ValueError(
                f"{family} config: use_sliding_window with layer_types {sorted(types)} (a window on "
                "some layers only) is not supported; all layers must be sliding_attention or "
                "use_sliding_window false"
            )


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 decoder + LM head; the arguments and errors of ``LlamaForCausalLM``, and a
    ValueError for a window on some layers only (``check_uniform_attention``)."""

    PARTS = DecoderParts(qk_norm=True)

    def __init__(self, hf_config, *args, **kwargs):
        check_uniform_attention(hf_config, "Qwen3")
        super().__init__(hf_config, *args, **kwargs)
