"""``kvserve doctor``: the report names every kernel library and the thread choice with its reason."""

import json

from kvserve.entrypoints import cli, doctor
from kvserve.model_executor.layers import native_lib


def test_doctor_json_lists_every_library_and_the_paths_used(capsys):
    assert doctor.main(["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    libs = {lib["name"]: lib for lib in r["libraries"]}
    assert set(libs) == {lib.name for lib in native_lib.all_libraries()}
    for lib in libs.values():
        # loaded with a path, or unavailable with the reason
        assert (lib["loaded"] and lib["path"]) or (not lib["loaded"] and lib["failure"]), lib
    assert set(r["cpu_features"]) == set(doctor.CPU_FEATURES)
    assert r["paths"]["linear"]["float32"].startswith("kvserve panel GEMM") == libs["kv_gemm"]["loaded"]
    quant = r["paths"]["linear, gguf quantized"]["float32"]
    assert quant.startswith("kvserve quantized GEMM") == libs["kv_quant_gemm"]["loaded"]
    assert r["paths"]["LoRA deltas"]["bfloat16"].startswith("kvserve kernel") == libs["kv_lora"]["loaded"]
    step = r["paths"]["decoder layers of a pure-decode step"]["float32"]
    if libs["kv_ops"]["loaded"] and libs["kv_attention"]["loaded"]:
        assert step.startswith("one kvserve call") == libs["kv_decode_layers"]["loaded"], step
    assert 1 <= r["threads"]["chosen"] <= r["threads"]["cores_usable"]
    assert r["threads"]["why"]


def test_doctor_says_whether_lora_decode_steps_stay_in_the_one_call(capsys, monkeypatch):
    from kvserve.model_executor.layers import native_layers, native_lora
    from kvserve.model_executor.models import native_decode

    def step_text() -> str:
        assert doctor.main(["--json"]) == 0
        return json.loads(capsys.readouterr().out)["paths"]["decoder layers of a pure-decode step"]["float32"]

    if not (native_layers.available() and native_lora.available()):
        assert "LoRA deltas included" not in step_text()
        return
    assert "LoRA deltas included" in step_text()  # FUSE_LORA: LoRA steps run the fused call
    monkeypatch.setattr(native_decode, "FUSE_LORA", False)
    assert "per-layer calls with LoRA" in step_text()


def test_doctor_says_a_fixed_thread_count_comes_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("KVSERVE_NUM_THREADS", "1")
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "Threads: 1 of" in out and "KVSERVE_NUM_THREADS=1" in out
    assert "Kernel libraries:" in out and "kvserve/csrc/gemm.c" in out
