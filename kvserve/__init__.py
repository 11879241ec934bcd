"""kvserve: an LLM inference and serving engine around a vLLM-V0-style scheduler.

Public API: ``LLM``, ``SamplingParams``, ``LLMEngine``, ``EngineArgs``, ``RequestOutput``,
``CompletionOutput``.
"""
from kvserve.config import EngineArgs
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput"]


def __getattr__(name):
    # Imported lazily so `import kvserve` (e.g. for SamplingParams) does not load torch.
    if name == "LLM":
        from kvserve.entrypoints.llm import LLM
        return LLM
    if name == "LLMEngine":
        from kvserve.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
