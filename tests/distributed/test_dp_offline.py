"""``LLM(data_parallel_size=2)``: a batch spread over two replicas gives the single engine's
outputs in the same order; bad input raises before anything is sent; Ray is never imported by
``import kvserve`` or by a single-process engine."""

import subprocess
import sys

import pytest

from tests.distributed.conftest import ENGINE_KWARGS

pytestmark = pytest.mark.slow


def test_import_kvserve_and_one_engine_do_not_import_ray(tiny_llama_dir):
    code = (
        "import sys, kvserve\n"
        "from kvserve import LLM, SamplingParams\n"
        "import kvserve.distributed, kvserve.entrypoints.openai.api_server\n"
        f"llm = LLM(model={str(tiny_llama_dir)!r}, num_gpu_blocks=16, max_model_len=64)\n"
        "llm.generate(['hi'], SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_llm_data_parallel_same_outputs_same_order(ray_runtime, tiny_llama_dir):
    from kvserve import LLM, SamplingParams

    kw = dict(model=str(tiny_llama_dir), **ENGINE_KWARGS)
    prompts = [f"Item {i}: the colour of the sky is" for i in range(8)] + [{"prompt_token_ids": [5, 6, 7, 8]}]
    params = [SamplingParams(max_tokens=6 + i % 3, temperature=0) for i in range(len(prompts))]
    expected = LLM(**kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(data_parallel_size=2, **kw)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.request_id for o in outs] == [o.request_id for o in expected]
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
        assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in expected]
        assert all(o.outcome == "finished" for o in outs)
        assert all(r.routed >= 3 for r in llm._dp.replicas)  # both replicas took a share
        # bad input: a ValueError naming the field, and nothing was sent
        routed = [r.routed for r in llm._dp.replicas]
        with pytest.raises(ValueError, match="max_model_len 256"):
            llm.generate(["ok", "x " * 300], SamplingParams(max_tokens=64), use_tqdm=False)
        with pytest.raises(ValueError, match="prompt"):
            llm.generate(["ok", ""], use_tqdm=False)
        assert [r.routed for r in llm._dp.replicas] == routed
        chat = llm.chat([[{"role": "user", "content": "hi"}]], SamplingParams(max_tokens=3, temperature=0))
        assert chat[0].outcome == "finished" and len(chat[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_llm_data_parallel_bad_model_path_is_a_value_error(ray_runtime, tmp_path):
    from kvserve import LLM

    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "missing"), data_parallel_size=2)


def test_llm_data_parallel_composes_with_tensor_parallel(ray_runtime, tiny_llama_dir):
    """DP=2 x TP=2 (four worker processes: each replica's driver spawns its peer rank inside
    its Ray actor) gives the single engine's greedy outputs in order."""
    from kvserve import LLM, SamplingParams

    kw = dict(model=str(tiny_llama_dir), **ENGINE_KWARGS)
    prompts = [f"Item {i}: the colour of the sky is" for i in range(4)]
    params = SamplingParams(max_tokens=5, temperature=0)
    expected = LLM(**kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(data_parallel_size=2, tensor_parallel_size=2, **kw)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
        assert all(o.outcome == "finished" for o in outs)
        assert all(r.routed >= 1 for r in llm._dp.replicas)
    finally:
        llm.shutdown()
