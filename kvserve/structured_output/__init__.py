"""Constrained decoding: grammar compilation (cached), per-sequence matcher state, and the
batched token bitmask the sampler applies. The scheduler knows nothing of this room."""

from kvserve.model_executor.layers.bitmask import allowed_tokens, apply_token_bitmask_, bitmask_words
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.compiler import GrammarCompiler, grammar_text
from kvserve.structured_output.limits import DEFAULT_LIMITS, GrammarLimits, check_constraint
from kvserve.structured_output.manager import (
    GrammarError,
    GroupBitmask,
    StructuredOutputManager,
    VerifyMasks,
    allowed_prefix,
)

__all__ = [
    "DEFAULT_LIMITS",
    "GrammarCompiler",
    "GrammarError",
    "GrammarLimits",
    "GroupBitmask",
    "StructuredOutputManager",
    "StructuredOutputsParams",
    "VerifyMasks",
    "allowed_prefix",
    "allowed_tokens",
    "apply_token_bitmask_",
    "bitmask_words",
    "check_constraint",
    "grammar_text",
]
