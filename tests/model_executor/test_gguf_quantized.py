"""``quantization="gguf"``: GGUF weights loaded as they are (``gguf_loader``) and run on the
quantized kernels, against our float model on the same weights dequantized (``gguf_convert``:
the float reference, itself checked against transformers' GGUF loader); malformed files.

Tiny models are written here as llama.cpp writes them (q/k rows permuted, linear weights
quantized by the ``gguf`` package); the default model's own Q4_1 GGUF is the slow end-to-end
test (greedy output equal to transformers on the dequantized weights, up to near-ties).
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize

from kvserve.model_executor import gguf_convert
from kvserve.model_executor.gguf_loader import load_gguf_model
from kvserve.ops import quant
from kvserve.worker.model_runner import ModelRunner
from tests.model_executor.helpers import ToyAllocator, ToySeq, llama_config, save_tiny
from tests.ops.test_quant_gemm import K_QUANTS, random_kquant_blocks

HF_TO_GGUF = {v: k for k, v in gguf_convert._GLOBAL_MAP.items()}
LAYER_TO_GGUF = {v: k for k, v in gguf_convert._LAYER_MAP.items()}
T = gguf.GGMLQuantizationType


def gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    assert m, hf
    return f"blk.{m.group(1)}.{LAYER_TO_GGUF[m.group(2)]}"


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter order (the inverse of ``gguf_convert.unpermute_qk``)."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, hf_model, cfg, qtype_of, shape_override=None) -> None:
    """Write ``hf_model`` as a llama GGUF; ``qtype_of(hf_name)`` picks each 2-D tensor's type."""
    w = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for a tied head
        a = t.detach().float().numpy()
        if name.endswith("q_proj.weight"):
            a = permute_qk(a, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            a = permute_qk(a, cfg.num_key_value_heads)
        if shape_override and name in shape_override:
            a = a[: shape_override[name]]
        qt = qtype_of(name) if a.ndim == 2 else T.F32
        if qt == T.F32:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(a))
        elif qt.name.lower() in K_QUANTS:  # the gguf package cannot quantize to these
            blocks = random_kquant_blocks(qt.name.lower(), a.shape[0], a.shape[1], rng)
            w.add_tensor(gguf_name(name), blocks, raw_dtype=qt)
        else:
            w.add_tensor(gguf_name(name), quantize(a, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference_model(gguf_path, cfg):
    """Our float model on the GGUF's weights dequantized (the reference)."""
    from kvserve.model_executor.models.llama import LlamaForCausalLM

    reader = gguf.GGUFReader(str(gguf_path))
    ref = LlamaForCausalLM(cfg, torch.float32, "cpu")
    ref.load_weights(gguf_convert.dequantize_tensors(reader, cfg).items())
    ref.prepack_linear_weights()
    return ref.eval()


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    seq = ToySeq(ids)
    runner = ModelRunner(model, 4, 64, None, sampler=None)
    inp = runner.prepare_inputs([seq.metadata(len(ids), ToyAllocator(64), 4)])
    with torch.inference_mode():
        return model.compute_logits(model(inp.input_ids, inp.positions, None, inp.attn))


def greedy(model, ids: list[int], steps: int) -> list[int]:
    """Greedy tokens through the paged cache: one prefill, then single-token decode steps (the
    native decode path on CPU)."""
    from kvserve.worker.cache_engine import CacheEngine

    cfg = model.config
    ce = CacheEngine(cfg.num_hidden_layers, model.num_kv_heads, model.head_dim, 4, 64, 0, model.dtype, "cpu")
    runner = ModelRunner(model, 4, 64, None, sampler=None)
    seq, alloc, out = ToySeq(ids), ToyAllocator(64), []
    chunk = len(ids)
    for _ in range(steps):
        md = [seq.metadata(chunk, alloc, 4)]
        inp = runner.prepare_inputs(md)
        with torch.inference_mode():
            h = model(inp.input_ids, inp.positions, ce.gpu_cache, inp.attn)
            tok = int(model.compute_logits(h[-1:]).argmax())
        seq.data.update_num_computed_tokens(chunk)
        seq.data.append_token_id(tok, 0.0)
        out.append(tok)
        chunk = 1
    return out


@pytest.fixture(autouse=True, scope="module")
def float_activations():
    """The references here are float-activation results: run the quantized kernels in that
    mode (int8 activations are checked by perplexity and test_quant_act8.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(quant.ACT_ENV, "float")
        yield


FUSED_PART = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}


@pytest.fixture
def tiny(tmp_path):
    cfg = llama_config(hidden_size=64, intermediate_size=96, vocab_size=128, tie_word_embeddings=True)
    hf = save_tiny(tmp_path / "hf", cfg)
    return cfg, hf, tmp_path


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_0, T.Q8_0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_load_equals_float_model_on_dequantized_weights(tiny, qtype, dtype):
    """Every linear weight and the (tied) embedding stay quantized; prefill logits equal the
    float reference to float32 rounding (bfloat16: to its rounding); greedy tokens through the
    paged cache (native decode steps) are the same."""
    cfg, hf, tmp = tiny
    path = tmp / "m.gguf"
    write_gguf(path, hf, cfg, lambda n: qtype)
    m = load_gguf_model(path, dtype, "cpu")
    for layer in m.layers:
        for w in (
            layer.self_attn.qkv_weight,
            layer.self_attn.o_weight,
            layer.mlp.gate_up_weight,
            layer.mlp.down_weight,
        ):
            assert isinstance(w, quant.QuantWeight) and w.qtype == qtype.name.lower()
    assert isinstance(m.embed_tokens, quant.QuantWeight) and m.lm_head is m.embed_tokens
    ref = reference_model(path, cfg)
    ids = [5, 17, 3, 99, 42, 8, 8, 120, 1]
    got, want = prefill_logits(m, ids), prefill_logits(ref, ids)
    atol = 1e-4 if dtype == torch.float32 else 0.05 * float(want.abs().max())
    assert torch.allclose(got, want, atol=atol), (got - want).abs().max()
    if dtype == torch.float32:
        assert greedy(m, ids, 6) == greedy(ref, ids, 6)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K])
def test_k_quant_load_equals_float_model_on_dequantized_weights(tmp_path, qtype):
    """The K-quants (superblocks of 256: hidden and intermediate sizes of 256 here), q/k rows
    permuted as whole superblock rows; logits and greedy tokens equal the float reference."""
    cfg = llama_config(hidden_size=256, intermediate_size=256, vocab_size=128, tie_word_embeddings=True)
    hf = save_tiny(tmp_path / "hf", cfg)
    path = tmp_path / "k.gguf"
    write_gguf(path, hf, cfg, lambda n: qtype)
    m = load_gguf_model(path, torch.float32, "cpu")
    assert m.layers[1].self_attn.qkv_weight.qtype == qtype.name.lower()
    assert isinstance(m.embed_tokens, quant.QuantWeight)
    ref = reference_model(path, cfg)
    ids = [5, 17, 3, 99, 42, 8, 8, 120, 1]
    got, want = prefill_logits(m, ids), prefill_logits(ref, ids)
    # random superblocks make large weights (logits ~1e3): float32 rounding, relative
    assert torch.allclose(got, want, atol=1e-4 * float(want.abs().max())), (got - want).abs().max()
    assert greedy(m, ids, 4) == greedy(ref, ids, 4)


def test_mixed_and_unkernelled_types_are_dequantized_at_load_with_a_log_line(tiny, caplog):
    """A fused weight whose parts differ in type, and a type without a kernel (Q5_1), run in
    float; the rest stays quantized; the logits still equal the reference."""
    cfg, hf, tmp = tiny
    path = tmp / "mixed.gguf"

    def qtype_of(name):
        if "layers.0.self_attn.v_proj" in name:
            return T.Q8_0  # q/k Q4_1, v Q8_0: qkv runs in float
        if "layers.1.mlp.down_proj" in name:
            return T.Q5_1
        return T.Q4_1

    write_gguf(path, hf, cfg, qtype_of)
    with caplog.at_level(logging.INFO, logger="kvserve.gguf"):
        m = load_gguf_model(path, torch.float32, "cpu")
    assert "Q5_1 tensors have no quantized kernel" in caplog.text
    assert not isinstance(m.layers[0].self_attn.qkv_weight, quant.QuantWeight)
    assert not isinstance(m.layers[1].mlp.down_weight, quant.QuantWeight)
    assert isinstance(m.layers[1].self_attn.qkv_weight, quant.QuantWeight)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    assert torch.allclose(prefill_logits(m, ids), prefill_logits(reference_model(path, cfg), ids), atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q5_0_is_repacked_to_q8_0_and_a_fused_weight_with_q8_0_parts_stays_quantized(tiny, caplog, dtype):
    """Q5_0 q/k/gate/up beside Q8_0 v (Gemma 3 Q4_K_M's mix): one log line says the type was
    repacked, every linear weight runs as Q8_0 blocks holding the Q5_0 weights exactly, and the
    logits and greedy tokens equal the float reference on the dequantized weights."""
    cfg, hf, tmp = tiny
    path = tmp / "q5_0.gguf"

    def qtype_of(name):
        if any(p in name for p in ("q_proj", "k_proj", "gate_proj", "up_proj")):
            return T.Q5_0
        return T.Q8_0

    write_gguf(path, hf, cfg, qtype_of)
    with caplog.at_level(logging.INFO, logger="kvserve.gguf"):
        m = load_gguf_model(path, dtype, "cpu")
    assert "Q5_0 tensors repacked to Q8_0" in caplog.text
    assert "no quantized kernel" not in caplog.text
    floats = gguf_convert.dequantize_tensors(gguf.GGUFReader(str(path)), cfg)
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        for w, parts in (
            (layer.self_attn.qkv_weight, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
            (layer.mlp.gate_up_weight, ["mlp.gate_proj", "mlp.up_proj"]),
        ):
            assert isinstance(w, quant.QuantWeight) and w.qtype == "q8_0"
            # the blocks hold the file's dequantized weights bit for bit
            want_w = torch.cat([torch.as_tensor(floats[p + n + ".weight"]).float() for n in parts])
            assert torch.equal(quant.dequantize(w), want_w)
    ref = reference_model(path, cfg)
    ids = [5, 17, 3, 99, 42, 8, 8, 120, 1]
    got, want = prefill_logits(m, ids), prefill_logits(ref, ids)
    atol = 1e-4 if dtype == torch.float32 else 0.05 * float(want.abs().max())
    assert torch.allclose(got, want, atol=atol), (got - want).abs().max()
    if dtype == torch.float32:
        assert greedy(m, ids, 6) == greedy(ref, ids, 6)


def test_truncated_gguf_is_a_clear_error_naming_the_file(tiny):
    cfg, hf, tmp = tiny
    path = tmp / "m.gguf"
    write_gguf(path, hf, cfg, lambda n: T.Q4_1)
    data = path.read_bytes()
    for cut in (len(data) // 2, 200, 3):
        bad = tmp / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=rf"{bad.name}.*cannot be read \(truncated or corrupt"):
            load_gguf_model(bad, torch.float32, "cpu")


def test_unknown_tensor_type_is_a_clear_error_naming_the_file(tiny):
    cfg, hf, tmp = tiny
    path = tmp / "m.gguf"
    write_gguf(path, hf, cfg, lambda n: T.Q4_1)
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at : type_at + 4] = (250).to_bytes(4, "little")
    bad = tmp / "unknown.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"unknown\.gguf.*unknown type"):
        load_gguf_model(bad, torch.float32, "cpu")


def test_mismatched_shape_and_missing_tensor_name_file_and_tensor(tiny):
    cfg, hf, tmp = tiny
    path = tmp / "shape.gguf"
    write_gguf(path, hf, cfg, lambda n: T.Q4_1, shape_override={"model.layers.1.self_attn.k_proj.weight": 16})
    with pytest.raises(ValueError, match=r"shape\.gguf.*'blk\.1\.attn_k\.weight'.*shape \(16, 64\)"):
        load_gguf_model(path, torch.float32, "cpu")
    # a model config with more layers than the file has: the missing tensors are named
    path = tmp / "m.gguf"
    write_gguf(path, hf, cfg, lambda n: T.Q4_1)
    big = llama_config(
        hidden_size=64, intermediate_size=96, vocab_size=128, tie_word_embeddings=True, num_hidden_layers=3
    )
    with pytest.raises(ValueError, match=r"m\.gguf.*missing weights.*layers\.2\."):
        load_gguf_model(path, torch.float32, "cpu", hf_config=big)


def test_quantized_path_refuses_other_devices_and_dtypes(tiny):
    cfg, hf, tmp = tiny
    path = tmp / "m.gguf"
    write_gguf(path, hf, cfg, lambda n: T.Q4_1)
    with pytest.raises(ValueError, match="CPU only"):
        load_gguf_model(path, torch.float32, "cuda")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        load_gguf_model(path, torch.float16, "cpu")


def test_quantization_setting_is_validated(tmp_path):
    from kvserve.config import ModelConfig
    from kvserve.model_executor.model_loader import resolve_model_dir

    with pytest.raises(
        ValueError,
        match=re.escape(
            "quantization must be one of none|gguf|int8|int4|gptq|awq|compressed-tensors or unset, got 'awq4'"
        ),
    ):
        ModelConfig(quantization="awq4")
    with pytest.raises(ValueError, match="quantization must be one of none, gguf, int8"):
        resolve_model_dir(None, "int3")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf model file"):
        resolve_model_dir(str(tmp_path), "gguf")
    missing = tmp_path / "typo.gguf"  # a .gguf name that is not there: named as missing
    with pytest.raises(ValueError, match=re.escape(f"model path '{missing}' does not exist")):
        resolve_model_dir(str(missing), "gguf")


# ---------------------------------------------------------------- the default model (slow)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village",
    "List three colours:",
]


@pytest.mark.slow
def test_default_model_quantized_greedy_equals_transformers_on_dequantized_weights():
    """The shipped Q4_1 GGUF run quantized (float32 activations) gives transformers' greedy
    tokens on the dequantized weights (the float conversion), up to near-ties."""
    from transformers import AutoModelForCausalLM

    from kvserve import LLM, SamplingParams
    from kvserve.model_executor.model_loader import default_gguf_path
    from tests.golden import compare, hf_greedy

    converted = gguf_convert.converted_dir(default_gguf_path())
    hf = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    llm = LLM(quantization="gguf", num_gpu_blocks=64)
    model = llm.llm_engine.executor.model
    assert isinstance(model.layers[0].mlp.down_weight, quant.QuantWeight)
    tok = llm.llm_engine.tokenizer
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompt_ids],
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    )
    near_ties = 0
    for ids, out in zip(prompt_ids, outs):
        near_ties += compare(list(out.outputs[0].token_ids), hf_greedy(hf, ids, 8))
    assert near_ties < len(PROMPTS)


@pytest.mark.slow
def test_default_model_quantized_load_is_not_materialised_in_float():
    """Peak RSS of loading the quantized default model stays below its float32 weights alone
    (540 MB): measured +367 MB = the gguf package's reader (~160 MB, most of it the 49k-token
    vocabulary and merges parsed into numpy arrays, plus the mapped file's pages) + the Q4_1 /
    Q8_0 copies (92 MB) + the model's float norms, rotary tables and the reader's garbage."""
    code = (
        "import resource, torch\n"
        "from kvserve.model_executor.model_loader import default_gguf_path, load_hf_config, resolve_model_dir\n"
        "from kvserve.model_executor.gguf_loader import load_gguf_model\n"
        "cfg = load_hf_config(resolve_model_dir(None, 'gguf'))\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "m = load_gguf_model(default_gguf_path(), torch.float32, 'cpu', cfg)\n"
        "print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    base_kib, peak_kib = map(int, r.stdout.split()[-2:])
    assert (peak_kib - base_kib) / 1024 < 450, (base_kib, peak_kib)


def test_quantization_cli_flag():
    import argparse

    from kvserve.entrypoints.cli import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_args_from(p.parse_args([])).quantization is None
    assert engine_args_from(p.parse_args(["--quantization", "gguf"])).quantization == "gguf"
    for method in ("none", "int8", "int4", "gptq", "awq", "compressed-tensors"):
        assert engine_args_from(p.parse_args(["--quantization", method])).quantization == method
    # "none" reaches the worker as None: the float path every loader takes
    args = engine_args_from(p.parse_args(["--quantization", "none"]))
    assert args.create_configs(256)[0].quantization is None
    assert "none = float weights" in re.sub(r"\s+", " ", p.format_help())
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "bitsandbytes"])


def test_benchmark_counts_the_weight_bytes_a_decode_step_reads(tiny):
    """``kvserve bench quantized``'s bandwidth column: quantized blocks count their bytes,
    float weights 4 (float32) bytes per weight; the tied LM head is read once per step."""
    from kvserve.benchmarks import quantized as bench

    cfg, hf, tmp = tiny
    path = tmp / "m.gguf"
    write_gguf(path, hf, cfg, lambda n: T.Q4_1)
    m = load_gguf_model(path, torch.float32, "cpu")
    per_layer = (64 + 2 * 32) * 64 + 64 * 64 + 2 * 96 * 64 + 64 * 96  # qkv, o, gate/up, down weights
    q4_1 = 20 / 32  # bytes per weight
    assert bench.step_weight_bytes(m) == (2 * per_layer + 128 * 64) * q4_1
    ref = reference_model(path, cfg)
    assert bench.step_weight_bytes(ref) == (2 * per_layer + 128 * 64) * 4


@pytest.mark.skipif(not quant.available(), reason="no quantized kernels")
def test_lm_head_reads_two_int8_planes_not_one_in_the_int8_mode(tiny, monkeypatch):
    """In the int8-activation mode the layers' GEMVs quantize their input to one int8 plane, but
    the LM head does not: one plane of the final hidden state flipped the default model's first
    token on a demo prompt (a 'Paris' answer became a loop). It runs the act16 kernel (two
    planes), whose logits stay within d / 508 per element of the float-activation kernel's;
    the float mode keeps the float kernel."""
    cfg, hf, tmp = tiny
    path = tmp / "m.gguf"
    write_gguf(path, hf, cfg, lambda n: T.Q8_0)
    m = load_gguf_model(path, torch.float32, "cpu")
    hidden = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    monkeypatch.setenv("KVSERVE_QUANT_ACT", "float")
    assert torch.equal(m.compute_logits(hidden), quant.linear(hidden, m.lm_head, kernel="tile").float())
    monkeypatch.setenv("KVSERVE_QUANT_ACT", "int8")
    got = m.compute_logits(hidden)
    assert torch.equal(got, quant.linear(hidden, m.lm_head, kernel="act16").float())
    exact = hidden.double() @ quant.dequantize(m.lm_head).double().T
    _, d = quant.quantize_activations(hidden)
    w_abs = quant.dequantize(m.lm_head).double().abs()
    bound = (d.double().repeat_interleave(32, dim=1) / 508) @ w_abs.T + 1e-4 * exact.abs() + 1e-6
    assert ((got.double() - exact).abs() <= bound).all()
    one_plane = (quant.linear(hidden, m.lm_head, kernel="act8").double() - exact).abs().max()
    assert float((got.double() - exact).abs().max()) < float(one_plane) / 20  # two planes really ran


# ---------------------------------------------------------------- which path a .gguf runs on


@pytest.fixture(scope="module")
def engine_gguf(tmp_path_factory):
    """A tiny Q8_0 llama GGUF with tokenizer metadata, so that ``LLM`` can start on it."""
    from tests.model_executor.test_quant_inputs import TINY, write_tiny_gguf

    cfg = llama_config(**TINY)
    hf = save_tiny(tmp_path_factory.mktemp("hf"), cfg).cpu()
    path = tmp_path_factory.mktemp("gguf") / "engine.gguf"
    write_tiny_gguf(path, hf, cfg, T.Q8_0)
    return path


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A model cache of this test's own (what was converted can be checked), sharing the built
    native kernels of the usual cache (they would be compiled again in a fresh one)."""
    native = gguf_convert.cache_root() / "native"
    native.mkdir(parents=True, exist_ok=True)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "native").symlink_to(native, target_is_directory=True)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(cache))
    return cache


def _cached_weights(cache) -> list:
    return [p for d in cache.iterdir() if d.name != "native" for p in d.rglob("*.safetensors")]


def _start(path, caplog, **kw):
    """``LLM(model=path, **kw)``'s engine model and quantization, and its start-up log lines
    about GGUF weights."""
    from kvserve import LLM

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        llm = LLM(model=str(path), num_gpu_blocks=16, max_num_batched_tokens=64, **kw)
    try:
        engine = llm.llm_engine
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GGUF weights:")]
        return engine.executor.model, engine.model_config.quantization, lines
    finally:
        llm.shutdown()


def _layer_weights(model):
    for layer in model.layers:
        yield from (layer.self_attn.qkv_weight, layer.self_attn.o_weight)
        yield from (layer.mlp.gate_up_weight, layer.mlp.down_weight)


def test_explicit_gguf_runs_its_quantized_blocks_when_quantization_is_unset(engine_gguf, own_cache, caplog):
    model, quantization, lines = _start(engine_gguf, caplog)
    assert quantization == "gguf"
    assert all(isinstance(w, quant.QuantWeight) and w.qtype == "q8_0" for w in _layer_weights(model))
    # 2 layers x (qkv, o, gate_up, down) + the embedding + the untied LM head
    assert lines == [
        f"GGUF weights: running the file's quantized blocks (Q8_0: 10 weights) from {engine_gguf.resolve()}"
    ]
    # nothing was dequantized to disk: the cache holds the config and tokenizer only
    assert _cached_weights(own_cache) == []


def test_quantization_none_runs_the_float_conversion(engine_gguf, own_cache, caplog):
    model, quantization, lines = _start(engine_gguf, caplog, quantization="none")
    assert quantization is None
    assert not any(isinstance(w, quant.QuantWeight) for w in _layer_weights(model))
    assert lines == ["GGUF weights: dequantized to float32 (because quantization='none')"]
    assert len(_cached_weights(own_cache)) == 1  # the cached float conversion


def test_a_setting_that_needs_float_weights_falls_back_to_the_float_conversion_and_says_why(
    engine_gguf, own_cache, caplog
):
    """LoRA (the cheapest such setting to start) through the engine; the other settings through
    the choice itself, which is all the engine reads."""
    from kvserve.config import EngineArgs

    model, quantization, lines = _start(engine_gguf, caplog, enable_lora=True)
    assert quantization is None
    assert not any(isinstance(w, quant.QuantWeight) for w in _layer_weights(model))
    assert lines == [
        "GGUF weights: dequantized to float32 "
        "(because enable_lora: LoRA adapters apply to float weights only)"
    ]
    path = str(engine_gguf)
    for kw, why in [
        (dict(tensor_parallel_size=2), "tensor_parallel_size=2: quantized blocks are not sharded"),
        (dict(dtype="float16"), "dtype='float16': its kernels compute in float32 or bfloat16"),
        (dict(device="cuda"), "device='cuda': its kernels run on CPU only"),
    ]:
        assert EngineArgs(model=path, **kw).resolve_quantization() == (None, why)
    # settings the quantized path runs keep it
    for kw in (
        dict(dtype="bfloat16"),
        dict(enable_prefix_caching=True),
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
    ):
        assert EngineArgs(model=path, **kw).resolve_quantization() == ("gguf", None), kw


def test_auto_device_on_cuda_and_missing_kernels_fall_back_explicit_gguf_refuses_cuda(
    engine_gguf, monkeypatch
):
    from kvserve.config import EngineArgs

    path = str(engine_gguf)
    with monkeypatch.context() as mp:
        mp.setattr(quant, "available", lambda: False)
        quantization, why = EngineArgs(model=path).resolve_quantization(quant.available())
        assert quantization is None and "quantized kernels are not built" in why
        # asked for explicitly, the slow fallback still runs
        assert EngineArgs(model=path, quantization="gguf").resolve_quantization() == ("gguf", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineArgs(model=path).resolve_quantization() == (
        None,
        "device='auto' (CUDA is available): its kernels run on CPU only",
    )
    with pytest.raises(
        ValueError,
        match=re.escape("device='auto' (CUDA is available) is not supported with quantization='gguf'"),
    ):
        EngineArgs(model=path, quantization="gguf").resolve_quantization()


@pytest.mark.parametrize(
    "kw, setting",
    [
        (dict(enable_lora=True), "enable_lora is not supported with quantization='gguf' (LoRA"),
        (dict(dtype="float16"), "dtype='float16' is not supported with quantization='gguf' (its kernels"),
        (dict(device="cuda"), "device='cuda' is not supported with quantization='gguf' (its kernels"),
        (dict(tensor_parallel_size=2), "quantization='gguf' is not supported with tensor_parallel_size > 1"),
    ],
)
def test_explicit_gguf_with_a_setting_it_cannot_run_is_an_error_naming_it(engine_gguf, kw, setting):
    from kvserve.config import EngineArgs

    with pytest.raises(ValueError, match=re.escape(setting)):
        EngineArgs(model=str(engine_gguf), quantization="gguf", **kw)


def test_default_model_stays_on_its_float_conversion():
    """The golden tests compare the default model with transformers on the same float weights:
    unset quantization keeps it float; ``"gguf"`` still runs its blocks."""
    from kvserve.config import EngineArgs

    for model in (None, "default"):
        quantization, why = EngineArgs(model=model).resolve_quantization()
        assert quantization is None and why.startswith("the default model runs its float conversion")
    assert EngineArgs(quantization="gguf").resolve_quantization() == ("gguf", None)
    assert EngineArgs(quantization="none").resolve_quantization() == (None, "quantization='none'")


def test_quantization_none_on_a_quantized_checkpoint_is_an_error_naming_it(tmp_path, own_cache):
    """Such a checkpoint has no float weights to run: ``"none"`` is refused before its weights
    are read (unset runs its own format)."""
    import json

    from kvserve import LLM

    d = tmp_path / "gptq"
    save_tiny(d, llama_config())
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"quantization='none' asks for float weights, .*quant_method 'gptq'"
    ):
        LLM(model=str(d), quantization="none")


def test_generate_prints_which_weights_a_gguf_runs_on(engine_gguf, own_cache, capsys):
    from kvserve.entrypoints.cli import main

    argv = [
        "generate",
        "--model",
        str(engine_gguf),
        "--prompt",
        "a",
        "--max-tokens",
        "2",
        "--num-gpu-blocks",
        "16",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "(GGUF weights: running the file's quantized blocks (Q8_0: " in out and str(engine_gguf) in out
    assert main([*argv, "--quantization", "none"]) == 0
    assert "(GGUF weights: dequantized to float32 (because quantization='none'" in capsys.readouterr().out
