"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``) on the decoder skeleton of ``models.llama``.

Its parts beyond Llama's: checkpoints hold q/k/v and gate/up already fused
(``self_attn.qkv_proj.weight``, ``mlp.gate_up_proj.weight``; ``LlamaForCausalLM`` maps them onto
its fused parameters and splits each part for tensor parallelism), LongRoPE scaling (``longrope``
or ``su``: short and long factors, an attention factor; ``layers.rotary_embedding``), and on
Phi-4-mini a ``partial_rotary_factor`` (only the first part of each head is rotated) with tied
embeddings. Pure-decode CPU steps with partial rotary run the module path (the one-call native
decode step rotates whole heads).
"""

from __future__ import annotations

from kvserve.model_executor.layers.rotary_embedding import get_rope_parameters
from kvserve.model_executor.models.llama import LlamaForCausalLM
from kvserve.model_executor.models.qwen3 import check_uniform_attention


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 decoder + LM head; the arguments and errors of ``LlamaForCausalLM``.

    Raises:
        ValueError: ``rope_scaling`` of a type other than default / longrope / su (naming the
            field), besides ``LlamaForCausalLM``'s errors.
    """

    def __init__(self, hf_config, *args, **kwargs):
        rope_type = get_rope_parameters(hf_config)["rope_type"]
        if rope_type not in ("default", "longrope"):
            raise ValueError(
                f"Phi-3 config: rope_scaling.rope_type={rope_type!r} is not supported (default, longrope, su)"
            )
        check_uniform_attention(hf_config, "Phi-3")
        super().__init__(hf_config, *args, **kwargs)
