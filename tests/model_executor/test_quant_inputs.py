"""Malformed and unsupported quantized inputs, as a careless or hostile user hands them over:
each must be a ``ValueError`` naming the file and the tensor / metadata key / field / layer,
on every path that reads it (``LLM(model=x.gguf)`` converts to float first, ``quantization=
"gguf"`` reads the file as it is; HF directories through ``resolve_model_dir`` and
``load_model``), never an ``IndexError`` / ``KeyError`` / ``AttributeError`` from inside numpy,
the ``gguf`` package or transformers, and never a silent load of garbage.

GGUF files here carry a complete tokenizer (``write_tiny_gguf``: the default model's
byte-level BPE cut to its first ``SMALL_VOCAB`` tokens), so a file can be complete and still be
refused for exactly one defect.
"""

from __future__ import annotations

import functools
import json
import re

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.model_executor.gguf_loader import load_gguf_model
from kvserve.model_executor.model_loader import default_gguf_path, load_model, resolve_model_dir
from tests.model_executor.helpers import llama_config, save_tiny
from tests.model_executor.test_gguf_quantized import T, gguf_name, permute_qk
from tests.ops.quant_packers import quantize_dir

# The GGUF fixtures' vocabulary: the default model's first 2,048 tokens (17 special tokens, the
# byte alphabet, then tokens in merge order). Converting a GGUF's tokenizer (transformers builds a
# fast tokenizer from the metadata) costs seconds at the default 49,152 tokens and every
# refused-file test converts one; none of them is about the default vocabulary.
SMALL_VOCAB = 2048


@functools.cache
def _default_tokenizer_fields() -> dict:
    """The default model's ``tokenizer.*`` metadata: ``{key: (value, value type)}`` (read once:
    parsing the 49,152-token vocabulary takes seconds)."""
    reader = gguf.GGUFReader(str(default_gguf_path()))
    return {k: (f.contents(), f.types[0]) for k, f in reader.fields.items() if k.startswith("tokenizer.")}


@functools.cache
def _tokenizer_fields(vocab: int = SMALL_VOCAB) -> dict:
    """The default model's ``tokenizer.*`` metadata cut to its first ``vocab`` tokens:
    ``tokens`` / ``token_type`` truncated, ``merges`` limited to those whose two parts and result
    are all kept (a merge-ordered BPE vocabulary, so the cut is a complete BPE tokenizer of its
    own; special token ids 0-16 stay as they are). ``{key: (value, value type)}``."""
    fields = dict(_default_tokenizer_fields())
    tokens, ttype = fields["tokenizer.ggml.tokens"]
    kept = set(tokens[:vocab])
    fields["tokenizer.ggml.tokens"] = (tokens[:vocab], ttype)
    types, ttype = fields["tokenizer.ggml.token_type"]
    fields["tokenizer.ggml.token_type"] = (types[:vocab], ttype)
    merges, mtype = fields["tokenizer.ggml.merges"]
    pairs = (m.split(" ", 1) for m in merges)
    fields["tokenizer.ggml.merges"] = (
        [f"{a} {b}" for a, b in pairs if a in kept and b in kept and a + b in kept],
        mtype,
    )
    return fields


def write_tiny_gguf(
    path, hf_model, cfg, qtype=T.Q8_0, skip_keys=(), skip_tensors=(), tokenizer=True, metadata=None
):
    """``hf_model`` as a llama GGUF the way llama.cpp writes it (q/k rows permuted), linear
    weights and the embedding in ``qtype``, with the default model's tokenizer metadata cut to
    ``SMALL_VOCAB`` tokens (``cfg.vocab_size`` must match) unless ``tokenizer`` is False; metadata
    keys in ``skip_keys`` and HF tensors in ``skip_tensors`` are left out; ``metadata``
    overrides ``llama.*`` values (``{key: value}``)."""
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), "llama")
    adders = {
        "llama.context_length": (w.add_context_length, cfg.max_position_embeddings),
        "llama.embedding_length": (w.add_embedding_length, cfg.hidden_size),
        "llama.block_count": (w.add_block_count, cfg.num_hidden_layers),
        "llama.feed_forward_length": (w.add_feed_forward_length, cfg.intermediate_size),
        "llama.attention.head_count": (w.add_head_count, cfg.num_attention_heads),
        "llama.attention.head_count_kv": (w.add_head_count_kv, cfg.num_key_value_heads),
        "llama.attention.layer_norm_rms_epsilon": (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
        "llama.rope.freq_base": (w.add_rope_freq_base, 10000.0),
    }
    for key, (add, value) in adders.items():
        if key not in skip_keys:
            add((metadata or {}).get(key, value))
    for key, (value, vtype) in (_tokenizer_fields() if tokenizer else {}).items():
        if key in skip_keys:
            continue
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_string(key, value)
        else:
            w.add_uint32(key, int(value))
    for name, t in hf_model.state_dict().items():
        if name in skip_tensors or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        a = t.detach().float().cpu().numpy()
        if name.endswith("q_proj.weight"):
            a = permute_qk(a, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            a = permute_qk(a, cfg.num_key_value_heads)
        if a.ndim == 2 and qtype != T.F32:
            w.add_tensor(gguf_name(name), quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


TINY = dict(hidden_size=64, intermediate_size=96, vocab_size=SMALL_VOCAB)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    cfg = llama_config(**TINY)
    return cfg, save_tiny(tmp_path_factory.mktemp("hf"), cfg).cpu()


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test converts into its own cache (a refused file must leave nothing behind)."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory, tiny_hf):
    cfg, hf = tiny_hf
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, hf, cfg)
    return path


def _both_paths(path):
    """The errors of both user paths for ``path``: float conversion and ``quantization="gguf"``
    (which reads metadata, then the weights)."""
    errors = []
    with pytest.raises(ValueError) as e:
        resolve_model_dir(str(path))
    errors.append(str(e.value))
    with pytest.raises(ValueError) as e:
        resolve_model_dir(str(path), "gguf")
        load_gguf_model(path, torch.float32, "cpu")
    errors.append(str(e.value))
    return errors


def _layout(path):
    """(data offset, {tensor name: (start, end)}) of a readable GGUF file."""
    r = gguf.GGUFReader(str(path))
    return r.data_offset, {t.name: (t.data_offset, t.data_offset + t.n_bytes) for t in r.tensors}


def test_good_tiny_gguf_loads_on_both_paths(good_gguf):
    """The control: the file the other tests break is fine as written (its cut vocabulary a
    working tokenizer too)."""
    from transformers import AutoTokenizer

    assert (resolve_model_dir(str(good_gguf)) / "model.safetensors").is_file()
    tok = AutoTokenizer.from_pretrained(resolve_model_dir(str(good_gguf)))
    text = "Once upon a time, in a small village by the sea,"
    assert len(tok) == SMALL_VOCAB and tok.decode(tok(text).input_ids) == text
    assert (resolve_model_dir(str(good_gguf), "gguf") / "config.json").is_file()
    load_gguf_model(good_gguf, torch.float32, "cpu")


def test_gguf_truncated_anywhere_names_the_file_and_where_it_ends(tmp_path, good_gguf):
    """Found here: the float path (``LLM(model=x.gguf)``, the default) read the file without
    the checks of the quantized path: an ``IndexError`` from inside the gguf package, or a
    numpy reshape message naming neither file nor tensor."""
    data = good_gguf.read_bytes()
    data_start, spans = _layout(good_gguf)
    key_at = data.index(b"llama.embedding_length")  # inside the metadata
    info_at = data.index(b"blk.1.ffn_up.weight", key_at)  # inside the tensor infos
    start, end = spans["blk.1.ffn_down.weight"]
    cases = [
        (10, r"the 10-byte file is shorter than a GGUF header"),
        (key_at + 4, r"metadata entry \d+ of \d+ is truncated"),
        (
            key_at + len("llama.embedding_length") + 2,
            r"metadata entry \d+ of \d+ \('llama\.embedding_length'\)",
        ),
        (info_at + 2, r"tensor info \d+ of \d+ is truncated"),
        (info_at + len("blk.1.ffn_up.weight") + 6, r"tensor info \d+ of \d+ \('blk\.1\.ffn_up\.weight'\)"),
        ((start + end) // 2, r"tensor 'blk\.1\.ffn_down\.weight' \(Q8_0, shape \[64, 96\]\) is truncated"),
        (len(data) - 1, r"tensor '[^']+' \([A-Z0-9_]+, shape .*\) is truncated: its data ends at byte"),
    ]
    assert data_start < start
    for cut, where in cases:
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        for msg in _both_paths(bad):
            assert re.search(
                rf"GGUF file '[^']*cut{cut}\.gguf' cannot be read \(truncated or corrupt\?\): {where}", msg
            ), msg
    assert not any((tmp_path / "cache").glob("cut*")), "a refused file left a cache entry"


def test_gguf_that_is_text_or_empty_or_duplicates_a_tensor_or_has_an_unknown_type(tmp_path, good_gguf):
    text = tmp_path / "notes.gguf"
    text.write_text("these are my notes, not a model\n")
    for msg in _both_paths(text):
        assert re.search(r"notes\.gguf.*no GGUF magic \(the file starts with b'thes'", msg), msg
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    for msg in _both_paths(empty):
        assert re.search(r"empty\.gguf.*0-byte file", msg), msg
    data = bytearray(good_gguf.read_bytes())
    i = data.index(b"blk.1.attn_q.weight")
    dup = tmp_path / "dup.gguf"
    dup.write_bytes(bytes(data[:i] + b"blk.0" + data[i + 5 :]))
    for msg in _both_paths(dup):
        assert re.search(r"dup\.gguf.*tensor 'blk\.0\.attn_q\.weight' appears twice", msg), msg
    data = bytearray(good_gguf.read_bytes())
    at = data.index(b"blk.0.ffn_gate.weight") + len("blk.0.ffn_gate.weight")
    n_dims = int.from_bytes(data[at : at + 4], "little")
    data[at + 4 + 8 * n_dims : at + 8 + 8 * n_dims] = (250).to_bytes(4, "little")
    unk = tmp_path / "unk.gguf"
    unk.write_bytes(bytes(data))
    for msg in _both_paths(unk):
        assert re.search(
            r"unk\.gguf' has a tensor of unknown type: tensor 'blk\.0\.ffn_gate\.weight' has unknown type id 250",
            msg,
        ), msg


@pytest.mark.parametrize(
    "skip, message",
    [
        ({"tokenizer.ggml.tokens"}, r"has no tokenizer: metadata key\(s\) 'tokenizer\.ggml\.tokens' missing"),
        ({"tokenizer.ggml.model"}, r"has no tokenizer: metadata key\(s\) 'tokenizer\.ggml\.model' missing"),
        ({"tokenizer.ggml.merges"}, r"has no tokenizer: metadata key\(s\) 'tokenizer\.ggml\.merges' missing"),
        ({"llama.embedding_length"}, r"metadata key 'llama\.embedding_length' is missing"),
        ({"llama.block_count"}, r"metadata key 'llama\.block_count' is missing"),
        ({"llama.feed_forward_length"}, r"metadata key 'llama\.feed_forward_length' is missing"),
    ],
    ids=["tokens", "tokenizer-model", "merges", "embedding_length", "block_count", "feed_forward_length"],
)
def test_gguf_missing_metadata_is_named(tmp_path, tiny_hf, skip, message):
    """Found here: a GGUF without tokenizer metadata was a ``KeyError: 'tokens'`` (or
    ``'scores'``) from transformers; a missing size key a ``TypeError`` from ``int(None)``."""
    cfg, hf = tiny_hf
    path = tmp_path / "partial.gguf"
    write_tiny_gguf(path, hf, cfg, skip_keys=skip)
    for msg in _both_paths(path):
        assert re.search(rf"GGUF file '[^']*partial\.gguf'.*{message}", msg), msg


@pytest.mark.parametrize(
    "metadata, message",
    [
        (
            {"llama.attention.head_count_kv": 3},
            r"metadata key 'llama\.attention\.head_count_kv' must be a positive divisor of ",
        ),
        (
            {"llama.attention.head_count_kv": 0},
            r"metadata key 'llama\.attention\.head_count_kv' must be a positive divisor of ",
        ),
        (
            {"llama.attention.head_count": 3, "llama.attention.head_count_kv": 3},
            r"its metadata describes no valid llama model: .*not a multiple of the number of attention heads",
        ),
        ({"llama.block_count": 0}, r"metadata key 'llama\.block_count' must be a positive integer, got 0"),
    ],
    ids=["kv-heads-3", "kv-heads-0", "heads-3", "blocks-0"],
)
def test_gguf_inconsistent_metadata_is_named(tmp_path, tiny_hf, metadata, message):
    """Found here: heads that do not divide were a transformers ``StrictDataclass...Error``
    (not a ValueError) or an error without the file's name."""
    cfg, hf = tiny_hf
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, hf, cfg, metadata=metadata)
    for msg in _both_paths(path):
        assert re.search(rf"GGUF file '[^']*odd\.gguf': {message}", msg, re.S), msg


def test_gguf_of_another_architecture_names_the_file(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for msg in _both_paths(tmp_path / "phi.gguf"):
        assert re.search(
            r"phi\.gguf': general.architecture 'phi2' is not supported \(supported: llama, qwen2, qwen3, phi3, "
            r"qwen2moe, qwen3moe, olmoe, gemma2, gemma3\)",
            msg,
        ), msg


def test_gguf_float_path_checks_shapes_and_names_before_caching(tmp_path, tiny_hf):
    """Found here: the float path converted (and cached) a GGUF whose tensors disagree with its
    own metadata; the error came later, naming the cache directory, not the GGUF file or its
    tensor."""
    cfg, hf = tiny_hf
    wrong = llama_config(**{**TINY, "intermediate_size": 128})  # metadata says 96
    path = tmp_path / "shape.gguf"
    write_tiny_gguf(path, save_tiny(tmp_path / "hf128", wrong).cpu(), cfg)
    for msg in _both_paths(path):
        assert re.search(
            r"shape\.gguf': tensor 'blk\.0\.ffn_gate\.weight': .*shape \(128, 64\), expected \(96, 64\)", msg
        ), msg
    path = tmp_path / "missing.gguf"
    write_tiny_gguf(path, hf, cfg, skip_tensors={"model.layers.1.mlp.down_proj.weight"})
    for msg in _both_paths(path):
        assert re.search(r"missing\.gguf'.*missing weights.*layers\.1\.mlp\.down_proj", msg), msg
    data = bytearray((tmp_path / "missing.gguf").read_bytes())
    i = data.index(b"blk.1.attn_q.weight")
    data[i : i + 19] = b"blk.1.attn_z.weight"
    path = tmp_path / "name.gguf"
    path.write_bytes(bytes(data))
    for msg in _both_paths(path):
        assert re.search(
            r"name\.gguf'.*'blk\.1\.attn_z\.weight' has no Hugging Face llama counterpart", msg
        ), msg
    assert not [p for p in (tmp_path / "cache").glob("*") if p.name != "gguf-sha256.json"]


# ------------------------------------------------------------------ HF directories
@pytest.fixture(scope="module")
def tiny_float(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"), llama_config()).cpu()


@pytest.mark.parametrize("qc", ["gptq", [], [{"quant_method": "gptq"}], 4])
def test_quantization_config_that_is_not_an_object_is_named(tmp_path, tiny_float, qc):
    """Found here: ``"quantization_config": "gptq"`` (or a list) crashed inside transformers'
    config repr with an ``AttributeError``."""
    quantize_dir(tiny_float, tmp_path / "q", tmp_path / "f", "gptq", group_size=32)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"] = qc
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    message = r"config\.json: quantization_config must be an object \(with a quant_method\), got"
    with pytest.raises(ValueError, match=message):
        resolve_model_dir(str(tmp_path / "q"))
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path / "q", torch.float32, "cpu")


@pytest.mark.parametrize(
    "method, tensor", [("gptq", "scales"), ("awq", "scales"), ("compressed-tensors", "weight_scale")]
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_scales_are_refused_naming_the_tensor(tmp_path, tiny_float, method, tensor, bad):
    """Found here: a NaN scale loaded silently (every logit NaN at the first request)."""
    q = tmp_path / "q"
    quantize_dir(tiny_float, q, tmp_path / "f", method, group_size=32)
    name = f"model.layers.1.mlp.up_proj.{tensor}"
    t = load_file(str(q / "model.safetensors"))
    t[name] = t[name].clone()
    t[name].view(-1)[3] = bad
    save_file(t, str(q / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=rf"model\.safetensors: tensor '{re.escape(name)}' has 1 non-finite value"
    ):
        load_model(q, torch.float32, "cpu")


def test_compressed_tensors_part_without_its_scale_is_named(tmp_path, tiny_float):
    q = tmp_path / "q"
    quantize_dir(tiny_float, q, tmp_path / "f", "compressed-tensors")
    t = load_file(str(q / "model.safetensors"))
    del t["model.layers.0.self_attn.k_proj.weight_scale"]
    save_file(t, str(q / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' is torch\.int8 \(integer\), expected a float "
        r"weight \(its weight_scale is missing, while 'model\.layers\.0\.self_attn\.q_proj\.weight_scale' is there\)",
    ):
        load_model(q, torch.float32, "cpu")


def test_float_checkpoint_errors_name_the_file(tmp_path, tiny_float):
    """Found here: a stray tensor or a missing weight in a plain safetensors directory was
    named without the file or directory it is in."""
    tiny_float.save_pretrained(tmp_path / "a")
    t = load_file(str(tmp_path / "a" / "model.safetensors"))
    t["model.layers.0.mlp.up_proj.weight_scale"] = torch.ones(96, 1)
    save_file(t, str(tmp_path / "a" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"a/model\.safetensors: unexpected weight 'model\.layers\.0\.mlp\.up_proj\.weight_scale'",
    ):
        load_model(tmp_path / "a", torch.float32, "cpu")
    tiny_float.save_pretrained(tmp_path / "b")
    t = load_file(str(tmp_path / "b" / "model.safetensors"))
    del t["model.layers.1.mlp.down_proj.weight"]
    save_file(t, str(tmp_path / "b" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"/b: checkpoint is missing weights: \['model\.layers\.1\.mlp\.down_proj\.weight'\]"
    ):
        load_model(tmp_path / "b", torch.float32, "cpu")


# ------------------------------------------------------------------ int8 / int4 on float checkpoints
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_int_quantization_of_a_layer_not_in_blocks_of_32_names_the_layers(tmp_path, method):
    """Found here: the error named ``quantize_q4_1: in_features=80`` but not which layer."""
    save_tiny(tmp_path, llama_config(intermediate_size=80))  # down_proj takes 80 inputs
    with pytest.raises(
        ValueError,
        match=rf"quantization='{method}' needs every linear layer's in_features to be a multiple of 32 .*"
        r"2 layer\(s\): model\.layers\.0\.mlp\.down_proj \(in_features=80\), model\.layers\.1\.mlp\.down_proj",
    ):
        load_model(tmp_path, torch.float32, "cpu", quantization=method)
    save_tiny(tmp_path / "h48", llama_config(hidden_size=48, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(
        ValueError,
        match=r"not so for 7 layer\(s\): model\.layers\.0\.self_attn\.q_proj/k_proj/v_proj \(in_features=48\).* and 3 more",
    ):
        load_model(tmp_path / "h48", torch.float32, "cpu", quantization=method)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_int_quantization_refuses_float16_at_load(tmp_path, method):
    """Found here: ``--quantization int8 --dtype float16`` started loading, then failed in the
    warm-up step with the kernel's shape-check message."""
    save_tiny(tmp_path, llama_config())
    with pytest.raises(
        ValueError, match=rf"quantization='{method}' needs dtype float32 or bfloat16.*got torch\.float16"
    ):
        load_model(tmp_path, torch.float16, "cpu", quantization=method)


@pytest.mark.parametrize("method", [None, "gptq"])
@pytest.mark.parametrize(
    "index, message",
    [
        (
            '{"weight_map": {"x": "model-00001-of-00002.safetensors"}}',
            r"names shard\(s\) missing from .*model-00001-of-00002",
        ),
        ("{not json", r"cannot be read as a JSON object"),
        ("[]", r"cannot be read as a JSON object"),
        ('{"weight_map": ["a"]}', r"'weight_map' must be an object"),
    ],
    ids=["missing-shard", "not-json", "list", "weight_map-list"],
)
def test_broken_shard_index_is_named(tmp_path, tiny_float, method, index, message):
    """Found here: an index naming a missing shard was a ``FileNotFoundError`` (float
    checkpoints), a list a ``TypeError``, bad JSON a message without the file."""
    d = tmp_path / "m"
    if method is None:
        tiny_float.save_pretrained(d)
    else:
        quantize_dir(tiny_float, d, tmp_path / "f", method, group_size=32)
    (d / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=rf"model\.safetensors\.index\.json.*{message}"):
        load_model(d, torch.float32, "cpu")


def test_a_gguf_module_without_its_reader_is_an_import_error_not_a_corrupt_file(good_gguf, monkeypatch):
    """A user's own ``gguf.py`` beside their script shadows the package (``import gguf`` finds a
    partly initialised module): the error names that module, and does not call the file corrupt."""
    import sys
    import types

    from kvserve.model_executor.gguf_convert import open_gguf

    fake = types.ModuleType("gguf")
    fake.__file__ = "/home/user/gguf.py"
    monkeypatch.setitem(sys.modules, "gguf", fake)
    with pytest.raises(ImportError, match=r"'/home/user/gguf\.py'.*no GGUFReader.*shadowing") as e:
        open_gguf(good_gguf)
    assert "corrupt" not in str(e.value)
