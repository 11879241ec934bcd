"""``kvserve doctor``: the report names every kernel library and the thread choice with its reason."""

import json

from kvserve.entrypoints import cli, doctor
from kvserve.ops import library


def test_doctor_json_lists_every_library_and_the_paths_used(capsys):
    assert doctor.main(["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    libs = {lib["name"]: lib for lib in r["libraries"]}
    assert set(libs) == {lib.name for lib in library.all_libraries()}
    for lib in libs.values():
        # loaded with a path, or unavailable with the reason
        assert (lib["loaded"] and lib["path"]) or (not lib["loaded"] and lib["failure"]), lib
    assert set(r["cpu_features"]) == set(doctor.CPU_FEATURES)
    # the panels exactly where prepack_weight packs float32 into them (AVX-512F)
    from kvserve.ops import gemm

    panels = libs["kv_gemm"]["loaded"] and gemm.beats_onednn()
    assert r["paths"]["linear"]["float32"].startswith("kvserve panel GEMM") == panels
    assert r["paths"]["linear"]["float32"].startswith("oneDNN") == (not panels)
    quant = r["paths"]["linear, gguf quantized"]["float32"]
    assert quant.startswith("kvserve quantized GEMM") == libs["kv_quant_gemm"]["loaded"]
    assert r["paths"]["LoRA deltas"]["bfloat16"].startswith("kvserve kernel") == libs["kv_lora"]["loaded"]
    step = r["paths"]["decoder layers of a pure-decode step"]["float32"]
    if libs["kv_ops"]["loaded"] and libs["kv_attention"]["loaded"]:
        fused = libs["kv_decode_layers"]["loaded"]
        # dense float32 weights on oneDNN (no AVX-512): only GGUF-quantized models take the call
        assert step.startswith("one kvserve call") == (fused and panels), step
        assert step.startswith("GGUF-quantized weights: one kvserve call") == (fused and not panels), step
    assert 1 <= r["threads"]["chosen"] <= r["threads"]["cores_usable"]
    assert r["threads"]["why"]


def test_doctor_says_whether_lora_decode_steps_stay_in_the_one_call(capsys, monkeypatch):
    from kvserve.model_executor.models import cpu_decode_step
    from kvserve.ops import decode_layers
    from kvserve.ops import lora as lora_kernel

    def step_text() -> str:
        assert doctor.main(["--json"]) == 0
        return json.loads(capsys.readouterr().out)["paths"]["decoder layers of a pure-decode step"]["float32"]

    if not (decode_layers.available() and lora_kernel.available()):
        assert "LoRA deltas included" not in step_text()
        return
    assert "LoRA deltas included" in step_text()  # FUSE_LORA: LoRA steps run the fused call
    monkeypatch.setattr(cpu_decode_step, "FUSE_LORA", False)
    assert "per-layer calls with LoRA" in step_text()


def test_doctor_says_a_fixed_thread_count_comes_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("KVSERVE_NUM_THREADS", "1")
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "Threads: 1 of" in out and "KVSERVE_NUM_THREADS=1" in out
    assert "Kernel libraries:" in out and "kvserve/csrc/gemm.c" in out


def test_doctor_reports_the_quantized_activation_mode_and_a_bad_one(capsys, monkeypatch):
    from kvserve.ops import quant

    def quant_text() -> str:
        assert doctor.main(["--json"]) == 0
        return json.loads(capsys.readouterr().out)["paths"]["linear, gguf quantized"]["float32"]

    if not quant.available():
        assert quant_text() == "torch: dequantized on every call (slow)"
        return
    # a bad value is reported (the doctor is where a user looks), not a traceback
    monkeypatch.setenv("KVSERVE_QUANT_ACT", "bogus")
    text = quant_text()
    assert "KVSERVE_QUANT_ACT='bogus'" in text and "refuses to load" in text, text
    monkeypatch.setenv("KVSERVE_QUANT_ACT", "float")
    text = quant_text()
    assert "few rows: float activations" in text and "int8" not in text, text
    assert text.endswith(f"more rows: dequantized float32 panels from {quant.PANEL_ROWS})"), text
    monkeypatch.setenv("KVSERVE_QUANT_ACT", "int8")
    text = quant_text()
    assert f"few rows: int8 activations, int8 dot products {quant.act8_isa()}" in text, text
    if quant.vnni_enabled("q8_0") and not quant.amx_enabled():
        assert f"VNNI int8 panels from {quant.VNNI_ROWS['q8_0']} / " in text, text
        monkeypatch.setenv("KVSERVE_QUANT_X4", "0")  # Q4_1 leaves the VNNI kernel
        assert f"VNNI int8 panels from {quant.VNNI_ROWS['q8_0']} (Q8_0) rows" in quant_text()


def test_doctor_counts_kv_tokens_per_gib_for_each_kv_cache_dtype(capsys, tmp_path):
    """SmolLM2-135M's shape by default (30 layers x 3 KV heads x 64: 23,040 bytes a token in
    bfloat16, 11,880 quantized), a --model directory's config.json otherwise, a bad one exits 2."""
    assert doctor.main(["--json"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv_cache"]
    assert kv["shape"] == [30, 3, 64]
    assert kv["tokens"]["bfloat16"] == 2**30 // (23040 * 16) * 16
    assert kv["tokens"]["int8"] == 2**30 // (11880 * 16) * 16
    assert kv["tokens"]["int8"] / kv["tokens"]["bfloat16"] >= 1.9
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert doctor.main(["--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 layers, 2 KV heads, head_dim 16" in out and "int8" in out
    assert doctor.main(["--model", str(tmp_path / "missing")]) == 2
    assert "--model: cannot read the attention shape" in capsys.readouterr().err
