"""Model directory resolution, weight loading errors, GGUF conversion and its cache."""

import os
import re
import time

import pytest
import torch

from kvserve.model_executor import gguf_convert
from kvserve.model_executor.model_loader import load_model, resolve_model_dir
from kvserve.transformers_utils.hf_config import get_sliding_window
from tests.model_executor.helpers import ToyAllocator, ToySeq, hf_logits, llama_config, save_tiny


def test_resolve_errors_name_path_and_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nope"))
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a directory"):
        resolve_model_dir(str(f))
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(ValueError, match=r"empty.*config.json and \*.safetensors"):
        resolve_model_dir(str(d))
    (d / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"missing \*.safetensors"):
        resolve_model_dir(str(d))


def test_resolve_and_load_sharded_checkpoint(tmp_path):

    hf = save_tiny(tmp_path / "src", llama_config())
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    d = resolve_model_dir(str(tmp_path / "sharded"))
    assert d == (tmp_path / "sharded").resolve()
    m = load_model(d, torch.float32, "cpu")
    from kvserve.worker.model_runner import ModelRunner

    seq = ToySeq([4, 5, 6, 7, 8])
    md = [seq.metadata(5, ToyAllocator(8), 4)]
    runner = ModelRunner(m, 4, 8, None, sampler=None)
    inp = runner.prepare_inputs(md)
    with torch.inference_mode():
        got = m.compute_logits(m(inp.input_ids, inp.positions, None, inp.attn))
    assert torch.allclose(got, hf_logits(hf, [4, 5, 6, 7, 8]).cpu(), atol=1e-4)


def test_bfloat16_load_casts(tmp_path):
    save_tiny(tmp_path, llama_config())
    m = load_model(tmp_path, torch.bfloat16, "cpu")
    assert m.layers[0].self_attn.qkv_weight.dtype == torch.bfloat16


@pytest.mark.parametrize("packing", ["host", "panels"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", ["llama_tied", "qwen2_bias"])
def test_prepacked_weights_match_plain_linear(tmp_path, arch, dtype, packing, monkeypatch):
    """CPU weights are prepacked at load (bfloat16 for oneDNN and, with AMX, ``gemm_amx``
    tiles; float32 into ``gemm`` panels where the CPU has AVX-512F, else left plain; with
    ``packing="panels"`` the panels wherever the kernels built); the logits must equal plain
    ``F.linear``'s: bit-identical with oneDNN alone, to bfloat16 rounding with the AMX kernel or
    bfloat16 panels (another summation order), to float32 rounding in float32 (tied LM head and
    q/k/v bias included)."""
    from transformers import Qwen2Config

    from kvserve.model_executor.models import llama
    from kvserve.ops import gemm, gemm_amx, gemm_bf16dot
    from kvserve.worker.model_runner import ModelRunner

    if arch == "llama_tied":
        cfg = llama_config(tie_word_embeddings=True)
    else:
        cfg = Qwen2Config(
            vocab_size=256,
            hidden_size=96,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            use_sliding_window=False,
        )
    save_tiny(tmp_path, cfg)

    def logits(m):
        md = [ToySeq([4, 5, 6, 7, 8, 9, 10]).metadata(7, ToyAllocator(8), 4)]
        inp = ModelRunner(m, 4, 8, None, sampler=None).prepare_inputs(md)
        with torch.inference_mode():
            return m.compute_logits(m(inp.input_ids, inp.positions, None, inp.attn))

    def is_packed(w):
        if dtype == torch.bfloat16:
            # panels where oneDNN would emulate bfloat16 (no AMX, no AVX512-BF16); the
            # dot-product GEMM where the CPU's VDPBF16PS is fast (no AMX)
            ours = (gemm_amx.AmxWeight, gemm.PanelWeight, gemm_bf16dot.DotWeight)
            return isinstance(w, ours) or w.is_mkldnn
        return isinstance(w, gemm.PanelWeight)

    if packing == "panels":
        if not gemm.available():
            pytest.skip("no C compiler for gemm")
        monkeypatch.setattr(gemm, "beats_onednn", gemm.available)
    packed = load_model(tmp_path, dtype, "cpu")
    if dtype == torch.float32 and not gemm.beats_onednn():
        # no AVX-512F: float32 stays a plain tensor (torch's GEMM), nothing packed to compare
        w = packed.layers[0].mlp.down_weight
        assert isinstance(w, torch.Tensor) and not w.is_mkldnn
        assert isinstance(packed.lm_head, torch.Tensor) and not packed.lm_head.is_mkldnn
        return
    if not is_packed(packed.layers[0].mlp.down_weight):
        pytest.skip("weight prepacking unavailable (no oneDNN, or no C compiler for gemm)")
    assert is_packed(packed.lm_head) and isinstance(packed.embed_tokens, torch.Tensor)
    assert not packed.embed_tokens.is_mkldnn
    monkeypatch.setattr(llama, "prepack_weight", lambda w: w)
    plain = load_model(tmp_path, dtype, "cpu")
    assert not is_packed(plain.layers[0].mlp.down_weight)
    a, b = logits(packed), logits(plain)
    assert a.abs().max() > 0.1
    if dtype == torch.bfloat16 and isinstance(
        packed.lm_head, (gemm_amx.AmxWeight, gemm.PanelWeight, gemm_bf16dot.DotWeight)
    ):
        torch.testing.assert_close(a, b, rtol=0.03, atol=0.03 * float(b.abs().max()))
    elif dtype == torch.bfloat16:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_missing_weight_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path, llama_config())
    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layers.1.mlp.up_proj"):
        load_model(tmp_path, torch.float32, "cpu")


def _rewrite_header(path, edit) -> None:
    """Apply ``edit`` to the JSON header of the safetensors file ``path`` (data left as is)."""
    import json
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _first_entry(header) -> dict:
    """The header entry of the tensor whose data starts the data section."""
    return next(v for k, v in header.items() if k != "__metadata__" and v["data_offsets"][0] == 0)


@pytest.mark.parametrize(
    "case, message",
    [
        # fewer bytes than the shape needs: the rest of the weight would stay uninitialised
        ("short_offsets", r"data_offsets \[0, 4\] \(4 bytes\), expected \d+ bytes for F32 shape"),
        ("no_dtype", r"malformed safetensors header: entry .* needs dtype, shape and data_offsets"),
        ("huge_header_length", r"not a safetensors file: its header length 18446744073709551615 is past"),
    ],
)
def test_corrupt_safetensors_header_is_refused_naming_the_file(tmp_path, case, message):
    save_tiny(tmp_path, llama_config())
    path = tmp_path / "model.safetensors"
    if case == "huge_header_length":
        raw = path.read_bytes()
        path.write_bytes(b"\xff" * 8 + raw[8:])
    elif case == "short_offsets":
        _rewrite_header(path, lambda h: _first_entry(h)["data_offsets"].__setitem__(1, 4))
    else:
        _rewrite_header(path, lambda h: _first_entry(h).pop("dtype"))
    with pytest.raises(ValueError, match=rf"model.safetensors.*{message}"):
        load_model(tmp_path, torch.float32, "cpu")


def test_sliding_window_policy():
    from transformers import MistralConfig, Qwen2Config

    assert get_sliding_window(MistralConfig(sliding_window=8)) == 8
    assert get_sliding_window(Qwen2Config(sliding_window=8, use_sliding_window=False)) is None
    assert get_sliding_window(llama_config()) is None


def test_unpermute_qk_inverts_llama_cpp_order():
    import numpy as np

    n_head, hd = 3, 8
    w = np.arange(n_head * hd * 2, dtype=np.float32).reshape(n_head * hd, 2)
    # llama.cpp: rows of each head go from (half, pair) to interleaved (pair, half)
    permuted = w.reshape(n_head, 2, hd // 2, 2).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(gguf_convert.unpermute_qk(permuted, n_head), w)


def test_conversion_cache_is_atomic_and_reused(tmp_path, monkeypatch):
    """A crash mid-conversion leaves nothing behind; a finished one is reused without work."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    fake = tmp_path / "Fake.gguf"
    fake.write_bytes(b"GGUF")
    calls = []

    def crashing(src, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed")

    monkeypatch.setattr(gguf_convert, "convert_gguf", crashing)
    with pytest.raises(RuntimeError):
        gguf_convert.converted_dir(fake)
    memo = gguf_convert.HASH_MEMO  # (the whole-file hash memo: not an entry)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [memo]

    def ok(src, out):
        calls.append(src)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(gguf_convert, "convert_gguf", ok)
    d1 = gguf_convert.converted_dir(fake)
    d2 = gguf_convert.converted_dir(fake)
    assert d1 == d2 and len(calls) == 1 and d1.name.startswith("Fake-")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([d1.name, memo])
    os.utime(fake, ns=(time.time_ns(), time.time_ns() + 10**9))  # same content, new mtime -> same key
    assert gguf_convert.converted_dir(fake) == d1
    with open(fake, "ab") as f:  # changed content -> new key
        f.write(b"more")
    assert gguf_convert.converted_dir(fake) != d1


@pytest.mark.parametrize(
    "name", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"]
)
def test_fused_part_with_too_few_rows_is_refused(tmp_path, name):
    """Found with the GGUF loader: a q/k/v or gate/up tensor shorter than its part of the
    fused weight passed the shape check as a prefix of the part, leaving rows unwritten."""
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path, llama_config())
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    tensors[name] = tensors[name][:-2].clone()
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=rf"{re.escape(name)}.*has shape \({tensors[name].shape[0]}, 64\), expected"
    ):
        load_model(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq", "exl2", "fbgemm_fp8", None])
def test_unsupported_quantized_hf_checkpoint_is_refused_naming_its_quant_method(tmp_path, method):
    import json

    save_tiny(tmp_path, llama_config())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=rf"config.json: quantization_config quant_method={method!r} is not supported"
    ):
        load_model(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize(
    "qc",
    [
        {"quant_method": "gptq", "bits": 4, "group_size": 128},
        {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"},
    ],
)
def test_quantized_config_over_float_weights_is_refused(tmp_path, qc):
    """A config declaring GPTQ / AWQ over a checkpoint without any packed tensor: no silent
    float load under a quantized label."""
    import json

    save_tiny(tmp_path, llama_config())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"declares quant_method='{qc['quant_method']}' but no module has"):
        load_model(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32])
def test_integer_tensor_under_a_float_weight_name_is_refused(tmp_path, dtype):
    """int8/uint8/int32 tensors under plain float weight names are refused, not loaded as garbage."""
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path, llama_config())
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = torch.zeros(tensors[name].shape, dtype=dtype)
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{re.escape(name)}.*integer.*expected a float weight"):
        load_model(tmp_path, torch.float32, "cpu")


def test_quantization_none_resolves_to_the_float_conversion_and_unset_too(tmp_path, monkeypatch):
    """At this level ``None`` and ``"none"`` both take a GGUF's float conversion (the engine's
    automatic choice is made before, by ``EngineArgs.resolve_quantization``); ``"gguf"`` caches
    no weights."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    fake = tmp_path / "Fake.gguf"
    fake.write_bytes(b"GGUF")
    calls = []

    def convert(src, out):
        calls.append(src)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    d = resolve_model_dir(str(fake), "none")
    assert (d / "model.safetensors").is_file() and len(calls) == 1
    assert resolve_model_dir(str(fake)) == d and len(calls) == 1
    hf = tmp_path / "hf"
    save_tiny(hf, llama_config())
    assert resolve_model_dir(str(hf), "none") == hf.resolve()


def test_quantized_weight_types_counts_each_quantized_weight_once(tmp_path):
    """Per block type, a fused weight and a tied embedding / LM head once; none for a float model."""
    import gguf

    from kvserve.model_executor.gguf_loader import load_gguf_model
    from kvserve.model_executor.model_loader import quantized_weight_types
    from tests.model_executor.test_gguf_quantized import reference_model, write_gguf

    T = gguf.GGMLQuantizationType
    cfg = llama_config(hidden_size=64, intermediate_size=96, vocab_size=128, tie_word_embeddings=True)
    hf = save_tiny(tmp_path / "hf", cfg)
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, cfg, lambda n: T.Q8_0 if "down_proj" in n else T.Q4_1)
    model = load_gguf_model(path, torch.float32, "cpu")
    # 2 layers: qkv, o, gate_up in Q4_1 and down in Q8_0; the tied embedding in Q4_1
    assert quantized_weight_types(model) == {"Q4_1": 7, "Q8_0": 2}
    assert quantized_weight_types(reference_model(path, cfg)) == {}


def test_architecture_without_a_family_is_refused_naming_the_checkpoint(tmp_path):
    from transformers import T5Config

    T5Config(
        vocab_size=64, d_model=32, num_layers=1, num_heads=2, architectures=["T5ForConditionalGeneration"]
    ).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=re.escape(f"model in {str(tmp_path)!r} has architecture")):
        load_model(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_registry_maps_a_model_type_without_architectures(model_type):
    from types import SimpleNamespace

    from kvserve.model_executor.models import registry
    from kvserve.model_executor.models.llama import LlamaForCausalLM

    cfg = SimpleNamespace(architectures=None, model_type=model_type)
    assert registry.model_class(cfg, "x") is LlamaForCausalLM
    assert registry.model_class(SimpleNamespace(architectures=["Nope", "Qwen2ForCausalLM"]), "x") is (
        LlamaForCausalLM
    )


@pytest.mark.parametrize(
    "field, value, message",
    [
        # sizes that would allocate (or fail to allocate) a model of that size before any check
        (
            "num_hidden_layers",
            10**6,
            r"num_hidden_layers=1000000, but the checkpoint holds layers 0\.\.1 \(2 layers\)",
        ),
        (
            "vocab_size",
            10**11,
            r"vocab_size=100000000000, hidden_size=64, but the checkpoint's model\.embed_tokens",
        ),
    ],
)
def test_config_sizes_disagreeing_with_the_weights_are_refused_before_allocating(
    tmp_path, field, value, message
):
    import json

    save_tiny(tmp_path, llama_config())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"config\.json: {message}"):
        load_model(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize("head", ["same", "different", "other_dtype"])
def test_a_tied_head_that_differs_from_the_embedding_is_refused(tmp_path, head):
    """``tie_word_embeddings`` with an ``lm_head.weight`` in the checkpoint: the tied model reads
    the embedding, so a different head (transformers keeps it as it is) must not load silently."""
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path, llama_config(tie_word_embeddings=True))
    f = tmp_path / "model.safetensors"
    sd = load_file(str(f))
    emb = sd["model.embed_tokens.weight"]
    sd["lm_head.weight"] = {
        "same": emb.clone(),
        "different": emb + 1e-3,
        "other_dtype": emb.to(torch.bfloat16),
    }[head]
    save_file(sd, str(f), metadata={"format": "pt"})
    if head == "same":
        load_model(tmp_path, torch.float32, "cpu")  # the same values: nothing to choose
        return
    with pytest.raises(
        ValueError, match=r"config\.json sets tie_word_embeddings, but .*lm_head\.weight differs"
    ):
        load_model(tmp_path, torch.float32, "cpu")
