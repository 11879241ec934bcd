"""Adapters whose weights are finite but break the model's forward (huge weights, a huge
``lora_alpha``) are refused when read, by a probe forward through the model, naming the
adapter and the fault: ``ValueError`` offline, HTTP 400 at ``/v1/load_lora_adapter``, a
``--lora-modules`` error at start. Sound adapters load as before, and the probe leaves the
device slots as they were."""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.lora.manager import LoRAManager
from kvserve.lora.peft import load_peft_adapter
from kvserve.lora_request import LoRARequest
from tests.engine.test_e2e_tiny import assert_idle
from tests.lora.adapters import lora_tensors, make_peft_adapter, write_adapter

pytest.importorskip("peft")

TARGETS = ("q_proj", "v_proj", "down_proj")
PARAMS = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
BROKEN = r"probe forward of 8 tokens .* gives (non-finite logits|a residual stream too large)"


@pytest.fixture(scope="module")
def paths(tiny_hf_model, tmp_path_factory):
    """PEFT-saved adapters for the tiny model: a sound one, one with lora_alpha 3e38 (finite
    scaled weights, overflowing deltas) and one whose weights are scaled by 1e15."""
    from safetensors.torch import load_file, save_file

    base = tiny_hf_model.cpu()
    d = tmp_path_factory.mktemp("probe")
    good = make_peft_adapter(base, d / "good", 4, TARGETS, alpha=16, seed=3)
    big_alpha = make_peft_adapter(base, d / "big_alpha", 4, TARGETS, alpha=3e38, seed=3)
    huge = make_peft_adapter(base, d / "huge", 4, TARGETS, alpha=16, seed=3)
    w = f"{huge}/adapter_model.safetensors"
    save_file({k: v * 1e15 for k, v in load_file(w).items()}, w)
    return {"good": good, "big_alpha": big_alpha, "huge": huge}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), enable_lora=True, max_loras=2, max_lora_rank=4, max_cpu_loras=4)


def test_the_broken_adapters_pass_the_weight_checks(paths, tiny_llama_dir):
    # what makes them dangerous: finite, in-range weights that only the forward shows broken
    from transformers import AutoConfig

    from kvserve.lora.peft import ModelShapes

    shapes = ModelShapes.from_hf_config(AutoConfig.from_pretrained(tiny_llama_dir))
    for name in ("big_alpha", "huge"):
        m = load_peft_adapter(paths[name], 1, shapes, 4)
        assert all(bool(torch.isfinite(b).all()) for _, b in m.weights.values())


@pytest.mark.parametrize("name", ["big_alpha", "huge"])
def test_offline_load_is_a_value_error_naming_the_adapter_and_the_engine_keeps_serving(llm, paths, name):
    eng = llm.llm_engine
    good = LoRARequest("good", 1, paths["good"])
    before = [
        o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=good)
    ]
    bad = LoRARequest(name, 7, paths[name])
    with pytest.raises(ValueError, match=rf"LoRA adapter '{name}' .*{BROKEN}"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=bad)
    with pytest.raises(ValueError, match=rf"'{name}'.*too large"):
        eng.add_lora(bad)
    assert 7 not in eng.list_loras()
    after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=good)]
    assert after == before
    assert_idle(eng)


def test_a_sound_adapter_is_probed_without_touching_the_device_slots(llm, paths):
    mgr = llm.llm_engine.executor.lora_manager
    llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False, lora_request=LoRARequest("good", 1, paths["good"]))
    held = list(mgr._slots)
    weights = [t.clone() for st in mgr.stacks for ab in st.values() for t in ab]
    calls = []
    probe = mgr._probe_fault
    mgr._probe_fault = lambda model: calls.append(model) or probe(model)
    try:
        assert mgr.add_lora(LoRARequest("good2", 2, paths["good"]))
    finally:
        del mgr._probe_fault
    assert len(calls) == 1 and calls[0] is not None  # the adapter's probe ran (the base's did not)
    assert mgr._slots == held and mgr.slot_of(2) is None
    assert all(
        torch.equal(a, b) for a, b in zip(weights, (t for st in mgr.stacks for ab in st.values() for t in ab))
    )
    # the modules point at the slots again
    layer = llm.llm_engine.executor.model.layers[0]
    assert layer.self_attn.lora_stacks["qkv"][0] is mgr.stacks[0]["qkv"][0]
    assert mgr.remove_lora(2)


def test_a_base_model_that_fails_the_probe_alone_gives_no_verdict(llm, paths, monkeypatch):
    mgr = llm.llm_engine.executor.lora_manager
    monkeypatch.setattr(LoRAManager, "_probe_fault", lambda self, model: "non-finite logits (NaN or inf)")
    assert mgr.add_lora(LoRARequest("unjudged", 9, paths["good"]))
    assert mgr.remove_lora(9)


def test_lora_alpha_whose_scaling_leaves_the_dtype_range_is_refused_naming_it(tmp_path, tiny_llama_dir):
    from transformers import AutoConfig

    from kvserve.lora.peft import ModelShapes

    shapes = ModelShapes.from_hf_config(AutoConfig.from_pretrained(tiny_llama_dir))
    t = lora_tensors(shapes.num_layers, shapes.in_out, 2, ("q_proj",))
    t = {k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in t.items()}  # PEFT's default B
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 2e5, "target_modules": ["q_proj"]}
    p = write_adapter(tmp_path / "a", cfg, t)
    load_peft_adapter(p, 1, shapes, 4, torch.float32)  # a scaling of 1e5 fits float32 ...
    with pytest.raises(
        ValueError, match=r"adapter_config.json: lora_alpha=200000.0 / r=2 .*scaling of 100000"
    ):
        load_peft_adapter(p, 1, shapes, 4, torch.float16)  # ... but not float16 (largest 65504)
    cfg["lora_alpha"] = 1e300
    p = write_adapter(tmp_path / "b", cfg, t)
    with pytest.raises(ValueError, match=r"lora_alpha=1e\+300 / r=2 .*not finite in torch.float32"):
        load_peft_adapter(p, 1, shapes, 4, torch.float32)


def test_http_load_is_400_naming_the_adapter_and_the_server_keeps_serving(tiny_llama_dir, paths):
    from kvserve.config import EngineArgs
    from tests.server_harness import running_server

    args = EngineArgs(
        model=str(tiny_llama_dir), device="cpu", dtype="float32", enable_lora=True, max_lora_rank=4, seed=0
    )
    with running_server(args, "tiny") as s, s.http() as h:
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": paths["big_alpha"]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "lora_path" and err["code"] == "invalid_lora_adapter"
        assert "LoRA adapter 'big'" in err["message"] and "probe forward" in err["message"], err
        assert "big" not in [m["id"] for m in h.get("/v1/models").json()["data"]]
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": paths["good"]})
        assert r.status_code == 200, r.text
        for model in ("tiny", "good"):
            r = h.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_cli_lora_modules_with_a_broken_adapter_exits_2_naming_it(tiny_llama_dir, paths, capsys):
    from kvserve.entrypoints import cli

    argv = ["generate", "--prompt", "hi", "--model", str(tiny_llama_dir), "--device", "cpu"]
    argv += ["--dtype", "float32", "--enable-lora", "--max-lora-rank", "4"]
    assert cli.main([*argv, "--lora-modules", f"huge={paths['huge']}"]) == 2
    err = capsys.readouterr().err
    assert f"--lora-modules huge={paths['huge']}: LoRA adapter 'huge'" in err and "probe forward" in err, err
