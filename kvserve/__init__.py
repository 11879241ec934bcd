"""kvserve: an LLM inference and serving engine around a vLLM-V0-style scheduler.

Public API: ``LLM``, ``SamplingParams``, ``RequestOutputKind``, ``StructuredOutputsParams``, ``BeamSearchParams``,
``LLMEngine``, ``EngineArgs``, ``RequestOutput``, ``CompletionOutput``.
"""

import os

# oneDNN (bfloat16 GEMMs; float32 ones where the native kernels are off) builds and caches one
# primitive per distinct row count and weight shape. ``linear.linear`` pads a step's rows to one
# of ~40 buckets up to 2,048 rows (``row_buckets``), so ever-new step sizes do not grow the
# cache, and the process, without bound (tests/adversarial/test_step_size_memory.py). Those
# buckets of the model's few weight shapes, with their reorders, come to a few hundred
# primitives: oneDNN's own default capacity of 1,024 holds them all, where a smaller bound
# would evict and rebuild them in a cycle. The ideep cache (LRU_CACHE_CAPACITY) keeps
# kvserve's bound. Read at oneDNN's first use, hence set before torch is imported; a user's
# own setting wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
os.environ.setdefault("LRU_CACHE_CAPACITY", "256")

from kvserve.config import EngineArgs
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "RequestOutputKind",
    "BeamSearchParams",
    "StructuredOutputsParams",
    "EngineArgs",
    "RequestOutput",
    "CompletionOutput",
]


def __getattr__(name):
    # Imported lazily so `import kvserve` (e.g. for SamplingParams) does not load torch.
    if name == "LLM":
        from kvserve.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from kvserve.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
