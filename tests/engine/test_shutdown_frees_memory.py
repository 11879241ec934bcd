"""``LLM.shutdown()`` frees the model: before, the engine kept its executor (weights, KV cache)
after shutdown, and an HTTP app's route closures, which FastAPI keeps in a process-wide cache,
kept the engine, so every server built in a process (the test suite builds dozens) held its model
until exit: the suite's process grew past 14 GB. Now shutdown drops the executor; the engine
refuses further steps with a clear error, and a second shutdown is a no-op."""

import gc
import weakref

import pytest

from kvserve import LLM, SamplingParams


def test_shutdown_releases_the_weights_and_refuses_later_steps(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_gpu_blocks=32, block_size=4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0].outputs[0].token_ids) == 4
    worker = weakref.ref(llm.llm_engine.executor)
    llm.shutdown()
    gc.collect()
    assert worker() is None, "the executor (weights, KV cache) outlived shutdown"
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)
    llm.shutdown()  # idempotent
    assert llm.llm_engine.get_num_unfinished_requests() == 0  # the refused call left nothing queued
