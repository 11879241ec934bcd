"""Which model class runs a checkpoint: its ``architectures`` (or ``model_type``) -> a native family.

One table, read by the loader: adding a family is one entry here plus its module. Modules are
imported only when their family is chosen, so an unused family costs nothing at start-up.
"""

from __future__ import annotations

import importlib

#: ``config.json`` ``architectures`` entry -> ``(module under kvserve.model_executor.models, class)``.
NATIVE_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("moe", "MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("moe", "MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "MoeForCausalLM"),
    "OlmoeForCausalLM": ("moe", "MoeForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    # encoder-only (pooling runner): the hidden states, no LM head
    "BertModel": ("bert", "BertModel"),
    "BertForMaskedLM": ("bert", "BertModel"),
    # a cross-encoder (pooling runner, score task): one relevance logit per text pair
    "BertForSequenceClassification": ("bert_classifier", "BertForSequenceClassification"),
}

#: Encoders with a one-output classification head: served as score models (cross-encoders).
CROSS_ENCODER_ARCHITECTURES = frozenset({"BertForSequenceClassification"})

#: Architectures that are encoder-only: ``runner='auto'`` serves them as pooling models.
ENCODER_ARCHITECTURES = frozenset({"BertModel", "BertForMaskedLM"}) | CROSS_ENCODER_ARCHITECTURES

#: ``model_type`` -> architecture, for configs that name no (or an unknown) architecture.
NATIVE_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "bert": "BertModel",
}


def native_architecture(hf_config) -> str | None:
    """The ``NATIVE_ARCHITECTURES`` key that runs ``hf_config`` natively, or ``None``.

    The config's ``architectures`` are tried in order, then its ``model_type``.
    """
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in NATIVE_ARCHITECTURES:
            return arch
    return NATIVE_MODEL_TYPES.get(getattr(hf_config, "model_type", ""))


def is_encoder(hf_config) -> bool:
    """Whether ``hf_config`` names an encoder-only family (``ENCODER_ARCHITECTURES``)."""
    return native_architecture(hf_config) in ENCODER_ARCHITECTURES


def is_cross_encoder(hf_config) -> bool:
    """Whether ``hf_config`` names a cross-encoder (``CROSS_ENCODER_ARCHITECTURES``)."""
    return native_architecture(hf_config) in CROSS_ENCODER_ARCHITECTURES


def model_class(hf_config, where: str) -> type:
    """The native model class for ``hf_config`` (a transformers config).

    Raises:
        ValueError: naming ``where`` (the checkpoint), the config's architectures and the
            supported ones, when no native family runs it.
    """
    arch = native_architecture(hf_config)
    if arch is None:
        archs = getattr(hf_config, "architectures", None) or getattr(hf_config, "model_type", None)
        raise ValueError(
            f"model in {where!r} has architecture {archs!r}; supported: {', '.join(NATIVE_ARCHITECTURES)}"
        )
    module, name = NATIVE_ARCHITECTURES[arch]
    return getattr(importlib.import_module(f"kvserve.model_executor.models.{module}"), name)
