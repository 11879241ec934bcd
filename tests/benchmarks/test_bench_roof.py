"""``kvserve bench roof``: the peaks' cache, the command on a tiny config (quick peaks), and the
fraction of the roof ``bench throughput`` reports."""

from __future__ import annotations

import json

import pytest

from kvserve.benchmarks import peaks as peaks_mod
from kvserve.benchmarks import roof
from kvserve.sim.roofline import ModelShape, offline_steps, run_cost

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 256,
}


def _fake_peaks(gflops: float = 100.0, gb_s: float = 10.0) -> peaks_mod.Peaks:
    return peaks_mod.Peaks(
        "test cpu",
        [],
        1,
        "t",
        gemm=[
            {"dtype": "float32", "backend": "a", "shape": [1, 1, 1], "gflops": gflops / 2},
            {"dtype": "float32", "backend": "b", "shape": [1, 1, 1], "gflops": gflops},
            {"dtype": "bfloat16", "backend": "a", "shape": [1, 1, 1], "gflops": 2 * gflops},
        ],
        bandwidth=[
            {"method": "read", "gb_per_s": gb_s, "read_only": True},
            {"method": "copy", "gb_per_s": 3 * gb_s, "read_only": False},
        ],
    )


def test_peaks_pick_the_best_row_of_a_dtype_and_the_best_read():
    p = _fake_peaks()
    assert p.peak_flops("float32") == 100e9
    assert p.peak_flops("bfloat16") == 200e9
    assert p.peak_flops("int8") == 100e9  # none measured: float32's
    assert p.peak_bandwidth() == 10e9  # the copy's higher figure counts writes too: not a read


def test_peaks_are_cached_per_key_and_remeasured_on_request(tmp_path, monkeypatch):
    calls = []

    def fake_measure(quick=False, log=None):
        calls.append(quick)
        return _fake_peaks(gflops=len(calls) * 10.0)

    monkeypatch.setattr(peaks_mod, "measure", fake_measure)
    monkeypatch.setattr(peaks_mod, "cache_path", lambda threads: tmp_path / f"peaks-{threads}.json")
    first, cached = peaks_mod.load_or_measure()
    assert not cached and first.peak_flops("float32") == 10e9
    again, cached = peaks_mod.load_or_measure()
    assert cached and again == first and calls == [False]
    fresh, cached = peaks_mod.load_or_measure(remeasure=True)
    assert not cached and fresh.peak_flops("float32") == 20e9
    assert peaks_mod.load_or_measure()[0].peak_flops("float32") == 20e9  # the refreshed file
    quick, _ = peaks_mod.load_or_measure(remeasure=True, quick=True)
    assert quick.peak_flops("float32") == 30e9
    assert peaks_mod.load_or_measure()[0].peak_flops("float32") == 20e9  # quick ones are not cached


def test_peaks_are_measured_at_the_asked_thread_count_and_torch_s_is_restored(tmp_path, monkeypatch):
    import torch

    seen = []

    def fake_measure(quick=False, log=None):
        seen.append(torch.get_num_threads())
        return _fake_peaks()

    monkeypatch.setattr(peaks_mod, "measure", fake_measure)
    monkeypatch.setattr(peaks_mod, "cache_path", lambda threads: tmp_path / f"peaks-{threads}.json")
    before = torch.get_num_threads()
    want = 1 if before > 1 else 2
    peaks_mod.load_or_measure(threads=want)
    assert seen == [want] and torch.get_num_threads() == before
    assert (tmp_path / f"peaks-{want}.json").is_file()


def test_cache_key_names_threads():
    assert peaks_mod.cache_path(1) != peaks_mod.cache_path(2)


def test_quick_peaks_measure_every_dtype():
    p = peaks_mod.measure(quick=True)
    assert {r["dtype"] for r in p.gemm} == {"float32", "bfloat16", "int8"}
    assert p.peak_flops("float32") > 1e9 and p.peak_bandwidth() > 1e8


def test_roof_cli_quick_on_a_tiny_config(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(peaks_mod, "cache_path", lambda threads: tmp_path / "peaks.json")
    cfg, out = tmp_path / "config.json", tmp_path / "roof.json"
    cfg.write_text(json.dumps(TINY))
    assert roof.main(["--quick", "--model", str(cfg), "--dtypes", "float32", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "floor = max(FLOPs / peak FLOP/s, bytes / bandwidth)" in printed and "offline w64" in printed
    doc = json.loads(out.read_text())
    assert doc["peaks"]["quick"] and not (tmp_path / "peaks.json").exists()
    w64 = next(r for r in doc["floors"] if r["workload"] == "offline w64")
    reqs, _ = roof.w64_requests()
    cost = run_cost(ModelShape.from_hf_config(TINY), offline_steps(reqs))
    assert w64["gflop"] == pytest.approx(cost.flops / 1e9)
    assert w64["steps"] == max(o for _, o in reqs)
    p = peaks_mod.Peaks(**doc["peaks"])
    assert w64["floor_s"] == pytest.approx(
        max(cost.flops / p.peak_flops("float32"), cost.bytes / p.peak_bandwidth())
    )
    assert w64["floor_rate"] == pytest.approx(sum(o for _, o in reqs) / w64["floor_s"])
    assert [r["workload"] for r in doc["floors"]] == ["offline w64", "batch-1 decode", "embed"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtypes", "float8"], "--dtypes: ['float8'] not among"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--model", "/nonexistent"], "--model /nonexistent: no config.json there"),
    ],
)
def test_roof_cli_refuses_bad_flags(argv, message, capsys):
    assert roof.main(argv) == 2
    assert message in capsys.readouterr().err


def test_default_shapes_are_the_default_models(default_model_dir):
    real = json.loads((default_model_dir / "config.json").read_text())
    assert {k: real[k] for k in roof.SMOLLM2_135M} == roof.SMOLLM2_135M


def test_embed_lengths_without_the_tokenizer_are_words_plus_three(tmp_path):
    from kvserve import envs

    lengths, how = roof.embed_lengths(8, model_dir=str(tmp_path))
    assert how == "words + 3" and len(lengths) == 8
    unpacked = envs.cache_root() / "all-MiniLM-L6-v2"
    if not (unpacked / "tokenizer.json").is_file():
        pytest.skip("all-MiniLM-L6-v2 is not unpacked here: the stand-in cannot be checked against it")
    real, how = roof.embed_lengths(256)
    assert how == "all-MiniLM-L6-v2 tokenizer"
    assert real == roof.embed_lengths(256, model_dir=str(tmp_path))[0]
    config = json.loads((unpacked / "config.json").read_text())
    assert {k: config[k] for k in roof.MINILM_L6} == roof.MINILM_L6


def test_bench_throughput_reports_its_fraction_of_the_roof(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from kvserve.benchmarks.cli import main

    fake = _fake_peaks(gflops=50.0, gb_s=5.0)
    monkeypatch.setattr(peaks_mod, "load_or_measure", lambda **_: (fake, True))
    out, workload = tmp_path / "t.json", tmp_path / "w.jsonl"
    rows = [{"id": i, "prompt_token_ids": list(range(100 + i, 116 + i)), "output_len": 4} for i in range(2)]
    workload.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["throughput", "--model", str(tiny_llama_dir), "--workload", str(workload)]
    assert main([*argv, "--no-baseline", "--no-tqdm", "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cost = run_cost(ModelShape.from_hf_config(cfg, "float32"), offline_steps([(16, 4), (16, 4)]))
    floor_s = max(cost.flops / 50e9, cost.bytes / 5e9)
    assert doc["roof"]["floor_s"] == pytest.approx(floor_s)
    kv = doc["kvserve"]
    assert kv["pct_of_roof"] == pytest.approx(100 * kv["output_tokens_per_s"] * floor_s / 8)
    assert "% of roof" in capsys.readouterr().out


def test_no_roof_leaves_the_roof_out(tiny_llama_dir, tmp_path, monkeypatch):
    from kvserve.benchmarks.cli import main

    def refuse(**_):
        raise AssertionError("peaks measured under --no-roof")

    monkeypatch.setattr(peaks_mod, "load_or_measure", refuse)
    out, workload = tmp_path / "t.json", tmp_path / "w.jsonl"
    workload.write_text(
        json.dumps({"id": 0, "prompt_token_ids": list(range(100, 108)), "output_len": 2}) + "\n"
    )
    argv = ["throughput", "--model", str(tiny_llama_dir), "--workload", str(workload), "--no-roof"]
    assert main([*argv, "--no-baseline", "--no-tqdm", "--json-out", str(out)]) == 0
    assert json.loads(out.read_text())["roof"] is None


def test_bench_embed_reports_each_side_as_a_fraction_of_the_roof(tmp_path, monkeypatch):
    import torch

    from kvserve.benchmarks import embed

    fake = _fake_peaks(gflops=50.0, gb_s=5.0)
    monkeypatch.setattr(peaks_mod, "load_or_measure", lambda **_: (fake, True))
    (tmp_path / "config.json").write_text(json.dumps(roof.MINILM_L6))
    result = {"kvserve_sentences_per_s": 30.0, "st_sentences_per_s": 20.0}
    lengths = [12, 30, 7]
    embed._add_roof(result, tmp_path, lengths, torch.float32, remeasure=False)
    m = ModelShape.from_hf_config(roof.MINILM_L6)
    linear = 2 * 6 * m.layer_params() * sum(lengths)
    attention = m.flops_per_pair() * sum(n * n for n in lengths)
    floor_s = (linear + attention) / 50e9  # compute-bound: a few MB of weights at 5 GB/s is less
    assert result["roof"]["bound"] == "compute" and result["roof"]["floor_s"] == pytest.approx(floor_s)
    assert result["kvserve_pct_of_roof"] == pytest.approx(100 * 30.0 * floor_s / 3)
    assert result["st_pct_of_roof"] == pytest.approx(100 * 20.0 * floor_s / 3)
    assert "sentence-transformers" in embed._roof_line(result)
