"""Constrained decoding: grammar compilation (cached), per-sequence matcher state, and the
batched token bitmask the sampler applies. The scheduler knows nothing of this room."""

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.bitmask import allowed_tokens, apply_token_bitmask_, bitmask_words
from kvserve.structured_output.compiler import GrammarCompiler, grammar_text
from kvserve.structured_output.manager import (
    GrammarError,
    GroupBitmask,
    StructuredOutputManager,
    VerifyMasks,
    allowed_prefix,
)

__all__ = [
    "GrammarCompiler",
    "GrammarError",
    "GroupBitmask",
    "StructuredOutputManager",
    "StructuredOutputsParams",
    "VerifyMasks",
    "allowed_prefix",
    "allowed_tokens",
    "apply_token_bitmask_",
    "bitmask_words",
    "grammar_text",
]
