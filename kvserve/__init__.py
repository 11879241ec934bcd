"""kvserve: an LLM inference and serving engine around a vLLM-V0-style scheduler.

Public API: ``LLM``, ``SamplingParams``, ``StructuredOutputsParams``, ``BeamSearchParams``,
``LLMEngine``, ``EngineArgs``, ``RequestOutput``, ``CompletionOutput``.
"""

import os

# oneDNN (bfloat16 GEMMs; float32 ones where the native kernels are off) builds and caches one
# primitive per distinct row count and weight shape, ~0.7 MB each, by default up to 1,024 in
# each of two caches; a server meets ever-new step sizes, so that grew the process by over 1 GB
# (tests/adversarial/test_step_size_memory.py). A bound of 128 keeps the last ~25 step sizes
# (5 weight shapes each) warm. Read at oneDNN's first use, hence set before torch is imported;
# a user's own setting wins.
for _var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_var, "128")

from kvserve.config import EngineArgs  # noqa: E402
from kvserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
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
    if name == "BeamSearchParams":
        from kvserve.entrypoints.beam_search import BeamSearchParams

        return BeamSearchParams
    if name == "LLMEngine":
        from kvserve.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
