"""A model directory's generation_config.json gives the default sampling parameters of requests
that leave them out (LLM.generate without sampling_params, the server's completions and chats),
as vLLM's --generation-config auto; ``vllm`` turns it off. Also vLLM's LLM keywords and
gpu_memory_utilization on a tiny model."""

from __future__ import annotations

import json
import os

import pytest

from kvserve.config import EngineArgs
from kvserve.sampling_params import SamplingParams
from kvserve.transformers_utils.generation_config import generation_defaults
from tests.adversarial.conftest import TINY_SERVER_KWARGS
from tests.server_harness import running_server

GEN = {"temperature": 0.0, "max_new_tokens": 5, "top_k": 0, "do_sample": True, "bos_token_id": 1}
DEFAULTS = {"temperature": 0.0, "max_tokens": 5, "top_k": -1}


@pytest.fixture(scope="module")
def gen_model_dir(tiny_llama_dir, tmp_path_factory):
    """``tiny_llama_dir``'s files (linked) with a generation_config.json of ``GEN``."""
    d = tmp_path_factory.mktemp("tiny-gen")
    for name in os.listdir(tiny_llama_dir):
        if name != "generation_config.json":
            os.symlink(os.path.join(tiny_llama_dir, name), d / name)
    (d / "generation_config.json").write_text(json.dumps(GEN))
    return d


def test_generation_defaults_read_the_sampling_keys_only(gen_model_dir, tmp_path):
    assert generation_defaults("auto", gen_model_dir) == (
        DEFAULTS,
        str(gen_model_dir / "generation_config.json"),
    )
    assert generation_defaults("vllm", gen_model_dir) == ({}, None)
    assert generation_defaults("auto", tmp_path) == ({}, None)  # no file: kvserve's defaults
    # another directory's file, with overrides over it
    assert generation_defaults(str(gen_model_dir), tmp_path, {"temperature": 0.5, "max_tokens": 9})[0] == {
        "temperature": 0.5,
        "max_tokens": 9,
        "top_k": -1,
    }
    with pytest.raises(ValueError, match="generation_config=.*no generation_config.json there"):
        generation_defaults(str(tmp_path), gen_model_dir)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": "high"}))
    with pytest.raises(
        ValueError, match=r"generation_config.json: top_p must be a finite number, got 'high'"
    ):
        generation_defaults("auto", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match=r"generation_config.json: temperature"):
        generation_defaults("auto", tmp_path)
    with pytest.raises(ValueError, match="override_generation_config: 'beams' is not one of"):
        generation_defaults("vllm", None, {"beams": 2})


def test_llm_generate_without_params_uses_the_models_defaults(gen_model_dir):
    from kvserve import LLM

    llm = LLM(model=str(gen_model_dir), **TINY_SERVER_KWARGS)
    assert llm.llm_engine.generation_defaults == DEFAULTS
    assert llm.get_default_sampling_params().max_tokens == 5
    out = llm.generate(["Hello there"], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 or out.finish_reason == "stop"
    greedy = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert out.token_ids == greedy[0].outputs[0].token_ids
    # vLLM's generation_config="vllm": the file is not read
    off = LLM(model=str(gen_model_dir), generation_config="vllm", **TINY_SERVER_KWARGS)
    assert off.llm_engine.generation_defaults == {}
    assert off.get_default_sampling_params().max_tokens == SamplingParams().max_tokens == 16


def test_server_applies_the_defaults_only_to_fields_a_request_leaves_out(gen_model_dir):
    with running_server(EngineArgs(model=str(gen_model_dir), **TINY_SERVER_KWARGS), "tiny") as s:
        http = s.http()
        card = http.get("/v1/models").json()["data"][0]
        assert card["generation_defaults"] == DEFAULTS

        def complete(**body):
            r = http.post(
                "/v1/completions", json={"model": "tiny", "prompt": "Hello", "ignore_eos": True, **body}
            )
            assert r.status_code == 200, r.text
            return r.json()

        default = complete()
        assert default["usage"]["completion_tokens"] == 5  # max_new_tokens
        assert default["choices"][0]["text"] == complete(temperature=0, max_tokens=5)["choices"][0]["text"]
        assert complete(max_tokens=3)["usage"]["completion_tokens"] == 3
        chat = http.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True},
        ).json()
        assert chat["usage"]["completion_tokens"] == 5


def test_vllm_keywords_and_gpu_memory_utilization_size_the_pools(gen_model_dir, monkeypatch, caplog):
    """gpu_memory_utilization on CPU: the device pool is u x host memory less the process's
    resident memory; vLLM's swap_space is swap_space_gib; the ignored keywords are logged."""
    import logging

    from kvserve import LLM
    from kvserve.worker import worker as worker_mod

    gib = 2**30
    monkeypatch.setattr(worker_mod, "_host_memory_bytes", lambda: 4 * gib)
    monkeypatch.setattr(worker_mod, "_resident_bytes", lambda: int(0.9 * gib))
    kwargs = {k: v for k, v in TINY_SERVER_KWARGS.items() if k not in ("num_gpu_blocks", "num_cpu_blocks")}
    with caplog.at_level(logging.WARNING, logger="kvserve.vllm_compat"):
        llm = LLM(
            model=str(gen_model_dir),
            gpu_memory_utilization=0.25,
            swap_space=0.001,
            trust_remote_code=True,
            enforce_eager=True,
            kv_cache_dtype="auto",
            **kwargs,
        )
    bpb = llm.llm_engine.executor.bytes_per_block()
    assert llm.llm_engine.cache_config.num_gpu_blocks == (gib - int(0.9 * gib)) // bpb
    assert llm.llm_engine.cache_config.num_cpu_blocks == int(0.001 * gib) // bpb
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "trust_remote_code ignored" in logged and "enforce_eager ignored" in logged
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.2 leaves 0.00 GiB for the KV cache"):
        LLM(model=str(gen_model_dir), gpu_memory_utilization=0.2, **kwargs)


def test_pools_over_available_memory_warn_naming_gpu_memory_utilization(gen_model_dir, monkeypatch, caplog):
    """Pools that fit the machine but not the memory available now start with a WARNING naming
    the setting to lower (on CPU, gpu_memory_utilization is of host memory); pools within it
    start without one."""
    import logging

    from kvserve import LLM
    from kvserve.worker import worker as worker_mod

    gib = 2**30
    monkeypatch.setattr(worker_mod, "_host_memory_bytes", lambda: 4 * gib)
    monkeypatch.setattr(worker_mod, "_resident_bytes", lambda: int(0.9 * gib))
    monkeypatch.setattr(worker_mod, "_host_available_bytes", lambda: gib // 20)
    kwargs = {k: v for k, v in TINY_SERVER_KWARGS.items() if k not in ("num_gpu_blocks", "num_cpu_blocks")}
    with caplog.at_level(logging.WARNING, logger="kvserve.worker.worker"):
        llm = LLM(model=str(gen_model_dir), gpu_memory_utilization=0.25, swap_space=0, **kwargs)
    llm.shutdown()
    warned = [r.getMessage() for r in caplog.records if r.name == "kvserve.worker.worker"]
    assert len(warned) == 1
    assert "0.05 GiB of host memory is available now" in warned[0]
    assert warned[0].endswith(
        "lower gpu_memory_utilization (on CPU a fraction of the machine's physical memory)"
    )
    caplog.clear()
    monkeypatch.setattr(worker_mod, "_host_available_bytes", lambda: 4 * gib)
    with caplog.at_level(logging.WARNING, logger="kvserve.worker.worker"):
        llm = LLM(model=str(gen_model_dir), gpu_memory_utilization=0.25, swap_space=0, **kwargs)
    llm.shutdown()
    assert not [r for r in caplog.records if r.name == "kvserve.worker.worker"]


def test_host_available_bytes_reads_meminfo():
    """MemAvailable is read from /proc/meminfo in bytes: positive and within physical memory."""
    from kvserve.worker import worker as worker_mod

    available = worker_mod._host_available_bytes()
    total = worker_mod._host_memory_bytes()
    assert available is not None and total is not None
    assert 0 < available <= total
