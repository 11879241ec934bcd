"""kvserve: an LLM inference and serving engine around a vLLM-V0-style scheduler.

Public API: ``LLM``, ``SamplingParams``, ``StructuredOutputsParams``, ``BeamSearchParams``,
``LLMEngine``, ``EngineArgs``, ``RequestOutput``, ``CompletionOutput``.
"""

import os

# oneDNN (bfloat16 GEMMs; float32 ones where the native kernels are off) builds and caches one
# primitive per distinct row count and weight shape, ~0.7 MB each, by default up to 1,024 in
# each of two caches. ``llama.linear`` pads a step's rows to one of ~40 buckets up to 2,048 rows
# (``row_buckets``), which bounds how many exist (a server's ever-new step sizes once grew the
# process by over 1 GB: tests/adversarial/test_step_size_memory.py); 256 entries hold every
# bucket of the 4-5 weight shapes, so none is rebuilt. Read at oneDNN's first use, hence set
# before torch is imported; a user's own setting wins.
for _var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_var, "256")

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
