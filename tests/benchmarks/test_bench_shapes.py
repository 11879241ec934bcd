"""``kvserve bench shapes`` without peers: the named shapes against transformers' own models of
those configs, the random-weight checkpoint and GGUF writers on a tiny shape (read back by
transformers and by kvserve's GGUF reader), and the run -> table -> JSON plumbing with kvserve
alone."""

import json

import numpy as np
import pytest
import torch

from kvserve.benchmarks import shape_checkpoints as sc
from kvserve.benchmarks import shapes


@pytest.fixture
def shape_root(tmp_path, monkeypatch):
    """Checkpoints written under ``tmp_path`` instead of the user's cache."""
    monkeypatch.setattr(
        sc, "shape_dir", lambda name, layers=None: tmp_path / "shapes" / sc.cut_name(name, layers)
    )
    return tmp_path / "shapes"


@pytest.mark.parametrize("name", [n for n in sc.SHAPES if n != "tiny"])
def test_shape_tensors_are_those_of_the_transformers_model(name):
    """Every tensor the writer produces has the name and shape transformers' model of the same
    config holds (its tied LM head aside), so the parameter count is the model's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(sc.SHAPES[name])
    hf_cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert dict(sc.tensor_shapes(sc.SHAPES[name])) == want
    assert sc.parameter_count(sc.SHAPES[name]) == sum(p.numel() for p in model.parameters())


def test_llama_1b_is_the_published_size():
    # Llama-3.2-1B: 1,235,814,400 parameters (embedding tied to the LM head)
    assert sc.parameter_count(sc.SHAPES["llama-3.2-1b"]) == 1_235_814_400


def test_checkpoint_loads_in_transformers_with_its_weights(shape_root):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = sc.ensure_checkpoint("tiny", log=lambda m: None)
    assert d == shape_root / "tiny" / "hf"
    cfg = json.loads((d / "config.json").read_text())
    assert {k: cfg[k] for k in sc.SHAPES["tiny"]} == sc.SHAPES["tiny"]
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16)
    stored = load_file(str(d / "model.safetensors"))
    got = model.state_dict()
    for k, v in stored.items():
        assert torch.equal(got[k], v), k
    assert torch.equal(got["lm_head.weight"], stored["model.embed_tokens.weight"])  # tied
    w = stored["model.layers.0.mlp.up_proj.weight"].float()
    assert abs(w.std().item() - 0.02) < 0.002 and torch.all(stored["model.norm.weight"] == 1)
    tok = AutoTokenizer.from_pretrained(str(d))
    assert len(tok) == 49152 and tok.chat_template
    assert sc.ensure_checkpoint("tiny") == d  # cached: not written again


def test_a_layer_cut_is_its_own_checkpoint_with_the_shape_widths(shape_root):
    from transformers import AutoModelForCausalLM

    d = sc.ensure_checkpoint("tiny", log=lambda m: None, layers=1)
    assert d == shape_root / "tiny-1layers" / "hf"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1
    assert {k: cfg[k] for k in sc.SHAPES["tiny"] if k != "num_hidden_layers"} == {
        k: v for k, v in sc.SHAPES["tiny"].items() if k != "num_hidden_layers"
    }
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16)
    assert len(model.model.layers) == 1
    assert model.model.embed_tokens.weight.shape == (sc.SHAPES["tiny"]["vocab_size"], 64)


def test_gguf_holds_the_checkpoint_weights_and_a_padded_vocabulary(shape_root, monkeypatch):
    """The Q8_0 file, read by kvserve's GGUF converter (which undoes llama.cpp's q/k order),
    gives the checkpoint's weights back within Q8_0 rounding; its token list is padded to the
    shape's vocabulary."""
    from gguf import GGUFReader
    from safetensors.torch import load_file

    from kvserve.model_executor import gguf_convert

    padded = dict(sc.SHAPES["tiny"], vocab_size=49160)
    monkeypatch.setitem(sc.SHAPES, "tiny-padded", padded)
    path = sc.ensure_gguf("tiny-padded", "q8_0", log=lambda m: None)
    reader = GGUFReader(str(path))
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 49160
    assert len(reader.fields["tokenizer.ggml.token_type"].data) == 49160
    cfg = gguf_convert.build_config(reader, has_output=False)
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (64, 2, 49160)
    back = gguf_convert.dequantize_tensors(reader, cfg)
    stored = load_file(str(sc.shape_dir("tiny-padded") / "hf" / "model.safetensors"))
    assert set(stored) <= set(back)
    for k, v in stored.items():
        ref = v.float().numpy()
        # Q8_0: one scale per 32 values (at most max |x| / 127), rounding at most half a step,
        # plus the float16 scale's own rounding (2^-11 relative, over up to 127 steps)
        bound = np.abs(ref).max() / 127 * (0.5 + 127 * 2**-11) + 1e-6
        np.testing.assert_allclose(back[k].float().numpy(), ref, atol=bound, rtol=0, err_msg=k)


def test_run_table_and_json_with_kvserve_alone(shape_root, tmp_path, monkeypatch, capsys):
    """The whole command on the tiny shape, kvserve only (children run in-process): a row per
    format with its own measurements, no peer ratios, the table printed and the JSON written."""
    monkeypatch.setattr(shapes, "spawn_child", lambda spec: shapes.run_child(json.loads(json.dumps(spec))))
    out, wl = tmp_path / "r.json", tmp_path / "w.jsonl"
    reqs = [{"prompt_token_ids": list(range(100, 100 + n)), "output_len": 9} for n in (20, 33)]
    wl.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    argv = [
        "--workload",
        str(wl),
        "--shape",
        "tiny",
        "--engines",
        "kvserve",
        "--dtypes",
        "float32",
        "--gguf-types",
        "q8_0",
    ]
    argv += ["--num-prompts", "2", "--max-output-len", "4", "--batch1-tokens", "4", "--rounds", "1"]
    assert shapes.main(argv + ["--no-roof", "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["num_requests"] == 2 and doc["output_tokens"] == 8
    rows = {r["format"]: r for r in doc["results"]}
    assert set(rows) == {"float32", "gguf q8_0"}
    f32, q8 = rows["float32"], rows["gguf q8_0"]
    assert f32["raw"]["w64"]["output_tokens"] == 8 and f32["raw"]["w64"]["short"] == 0
    assert f32["w64_tok_s"] > 0 and f32["decode_tok_s"] > 0 and f32["peak_rss_mib"] > 0
    assert q8["w64_tok_s"] is None and q8["decode_tok_s"] > 0
    assert all(r["raw"]["batch1"]["runs"][0]["tokens"] == 4 for r in rows.values())
    assert (f32["peer"], q8["peer"]) == ("vllm float32", "llama.cpp q8_0")
    assert all(r[f"{k}_x_peer"] is None for r in rows.values() for k in ("w64", "decode", "rss"))
    assert doc["targets"] == []
    table = capsys.readouterr().out
    assert "gguf q8_0" in table and "llama.cpp q8_0" in table


def test_ratios_and_targets_pair_each_kvserve_row_with_its_peer():
    def r(engine, fmt, w64=None, dec=None, rss=None):
        base = {"w64_tok_s": w64, "decode_tok_s": dec, "peak_rss_mib": rss}
        return {"shape": "llama-3.2-1b", "engine": engine, "format": fmt, **base}

    rows = shapes.add_ratios(
        [
            r("kvserve", "float32", w64=26.0, dec=4.0, rss=6000),
            r("vllm", "float32", w64=20.0, rss=8000),
            r("kvserve", "bfloat16", w64=30.0, rss=4000),
            r("vllm", "bfloat16", w64=25.0, rss=3000),
            r("kvserve", "gguf q8_0", dec=12.0, rss=1500),
            r("llama.cpp", "q8_0", dec=10.0, rss=1400),
        ]
    )
    k32, kbf, kq8 = rows[0], rows[2], rows[4]
    assert (k32["w64_x_peer"], k32["rss_x_peer"], k32["decode_x_peer"]) == (1.3, 0.75, None)
    assert kbf["w64_x_peer"] == 1.2 and kbf["rss_x_peer"] == pytest.approx(4 / 3)
    assert kq8["decode_x_peer"] == pytest.approx(1.2) and kq8["w64_x_peer"] is None
    assert rows[1]["peer"] is None and rows[1]["w64_x_peer"] is None
    got = {(c["format"], c["ratio"]): c["pass"] for c in shapes.check_targets(rows)}
    assert got == {
        ("float32", "w64_x_peer"): True,
        ("bfloat16", "w64_x_peer"): False,
        ("gguf q8_0", "decode_x_peer"): True,
        ("float32", "rss_x_peer"): True,
        ("bfloat16", "rss_x_peer"): False,
    }


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--shape", "llama-9b"], "--shape"),
        (["--engines", "kvserve,tgi"], "--engines"),
        (["--gguf-types", "q2_k"], "--gguf-types"),
        (["--batch1-tokens", "1"], "--batch1-tokens"),
        (["--num-prompts", "0"], "--num-prompts"),
        (["--layers", "0"], "--layers"),
        (["--shape", "tiny", "--layers", "3"], "--layers"),
        (["--context", "8"], "--context"),
    ],
)
def test_bad_flags_are_named_before_anything_runs(argv, flag, capsys, shape_root):
    assert shapes.main(argv) == 2
    assert flag in capsys.readouterr().err
    assert not shape_root.exists()


def test_quick_fills_the_short_settings():
    s = shapes.settings(shapes.build_parser().parse_args(["--quick"]))
    assert (s["num_prompts"], s["max_output_len"], s["batch1_tokens"], s["rounds"]) == (8, 32, 32, 1)
    assert s["shapes"] == ["llama-3.2-1b"] and s["gguf_types"] == ["q8_0", "q4_0"]


def test_a_long_context_run_is_batch_one_after_the_long_prompt(shape_root, tmp_path, monkeypatch):
    """``--context``: no w64, the batch-1 prompt has that many ids (under the tokenizer's
    vocabulary), the context length grows to hold it, and the decode targets are checked."""
    monkeypatch.setattr(shapes, "spawn_child", lambda spec: shapes.run_child(json.loads(json.dumps(spec))))
    out = tmp_path / "r.json"
    argv = ["--shape", "tiny", "--engines", "kvserve", "--dtypes", "float32", "--gguf-types", ""]
    argv += ["--context", "600", "--batch1-tokens", "4", "--rounds", "1", "--max-model-len", "256"]
    assert shapes.main(argv + ["--no-roof", "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["num_requests"] == 0 and doc["batch1_prompt_tokens"] == 600
    assert doc["settings"]["max_model_len"] == 600 + 4 + 16
    (f32,) = doc["results"]
    assert f32["w64_tok_s"] is None and f32["decode_tok_s"] > 0
    assert f32["raw"]["batch1"]["runs"][0]["tokens"] == 4
    ids = shapes.long_prompt(600)
    assert ids == shapes.long_prompt(600) and len(set(ids)) > 500 and 100 <= min(ids) and max(ids) < 49_000
    base = {"shape": "s", "w64_tok_s": None, "peak_rss_mib": None}
    rows = shapes.add_ratios(
        [
            base | {"engine": "kvserve", "format": "float32", "decode_tok_s": 13.0},
            base | {"engine": "vllm", "format": "float32", "decode_tok_s": 10.0},
            base | {"engine": "kvserve", "format": "bfloat16", "decode_tok_s": None},
        ]
    )
    got = shapes.check_targets(rows, "s", shapes.CONTEXT_TARGETS)
    assert [(c["format"], c["pass"]) for c in got] == [("float32", True)]
