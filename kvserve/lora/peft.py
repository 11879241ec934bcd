"""Reading and validating a PEFT LoRA adapter directory.

A PEFT directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules`` ...) and ``adapter_model.safetensors`` with one ``lora_A`` ``[r, in]`` and
one ``lora_B`` ``[out, r]`` per adapted linear, under names like
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``. PEFT adds
``scale * B(A(x))`` to the linear's output, ``scale = lora_alpha / r`` (``lora_alpha /
sqrt(r)`` with rsLoRA).

Families whose transformers modules are already fused (Phi-3: ``self_attn.qkv_proj``,
``mlp.gate_up_proj``; ``ModelShapes.fused``) have adapters on those fused linears: ``B``'s rows
are the parts' outputs one after the other, so such an adapter is the same delta as one
adapter per part sharing ``A``, each with its rows of ``B`` -- that is how it is stored
(``split_fused``), and the serving side sees only per-part weights. Everything that would change that formula (DoRA, trained biases,
``modules_to_save``, per-module rank or alpha patterns, activated LoRA, replicated layers,
QA-LoRA, BD-LoRA, trained token embeddings, LoRA on parameters, Arrow, KaSA, MonteCLoRA) is
refused, not ignored.

Each file is opened only as a regular file (symlinks resolved; under ``allowed_root`` when one is
given): a FIFO or a device such as ``/proc/kmsg`` would block the reading thread for good or
never reach EOF. ``adapter_config.json`` is read up to ``MAX_ADAPTER_CONFIG_BYTES``, and the
weights file up to what a valid adapter for the model could hold (``max_weights_file_bytes``).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field

import torch

#: The Llama-family linears an adapter may target -> (our fused module, part index in it).
TARGET_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
#: A fused transformers linear (Phi-3's) -> the ``TARGET_MODULES`` parts of its output rows, in order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_PARENT = {
    "qkv_proj": "self_attn",
    "gate_up_proj": "mlp",
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

#: Largest ``adapter_config.json`` read, in bytes (PEFT writes a few hundred).
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
#: Largest safetensors JSON header, in bytes (the safetensors format's own limit).
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000

_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp(?:\.shared_expert)?)\.(\w+)"
    r"\.lora_(A|B)(?:\.[\w-]+)?\.weight$"
)
#: A LoRA weight on a mixture-of-experts layer's routed experts, router or shared-expert gate
#: (group 1: the target, e.g. ``mlp.experts.0.gate_proj``, ``block_sparse_moe.experts.1.w1``).
_EXPERT_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.\d+\."
    r"((?:mlp|block_sparse_moe)\.(?:experts(?:\.\d+)?(?:\.\w+)?|gate|shared_expert_gate))\.lora_"
)


@dataclass
class LoRAModel:
    """One adapter's weights on CPU, per decoder layer and target linear.

    Attributes:
        lora_int_id: the request's id; rank: the largest rank of its linears.
        scaling: ``lora_alpha / r`` (or ``/ sqrt(r)`` with rsLoRA), already folded into ``B``.
        weights: ``(layer, target_module)`` -> ``(A [r, in], scaling * B [out, r])`` in the
            model dtype (``target_module`` a PEFT name such as ``"q_proj"``).
        path: the directory it was read from.
    """

    lora_int_id: int
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    path: str = ""

    def num_bytes(self) -> int:
        """Bytes held by the weights."""
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values()
        )


@dataclass(frozen=True)
class ModelShapes:
    """The base model's linear shapes a LoRA must match.

    Attributes:
        num_layers: decoder layers; in_out: PEFT target name -> ``(in_features, out_features)``.
        fused: whether the family's transformers modules fuse q/k/v and gate/up (Phi-3), so
            that its adapters target ``FUSED_MODULES`` instead of the parts.
    """

    num_layers: int
    in_out: dict[str, tuple[int, int]]
    fused: bool = False
    #: A mixture-of-experts family's architecture (for messages), else "".
    family: str = ""
    #: Mixture-of-experts families: layer -> (the PEFT parent of its MLP linears, ``"mlp"`` for
    #: a dense layer or ``"mlp.shared_expert"``, and their intermediate size); a layer absent
    #: has only routed experts, which take no LoRA. None: every layer's MLP is ``"mlp"`` of
    #: ``in_out``'s sizes.
    mlp: dict[int, tuple[str, int]] | None = None

    def mlp_parent(self, layer: int) -> str | None:
        """The PEFT parent of layer ``layer``'s MLP linears, or None where it has none."""
        if self.mlp is None:
            return "mlp"
        got = self.mlp.get(layer)
        return None if got is None else got[0]

    def layer_in_out(self, layer: int, module: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of ``module`` (a ``TARGET_MODULES`` name) in layer
        ``layer``: ``in_out``'s, but an MoE layer's MLP linears take its own intermediate size."""
        fin, fout = self.in_out[module]
        if self.mlp is None or _PARENT[module] != "mlp" or layer not in self.mlp:
            return fin, fout
        inter = self.mlp[layer][1]
        return (inter, fout) if module == "down_proj" else (fin, inter)

    @property
    def module_names(self) -> list[str]:
        """The PEFT target names an adapter of this model may use: ``TARGET_MODULES``, and on a
        fused family also ``FUSED_MODULES`` (what PEFT names its linears)."""
        return list(TARGET_MODULES) + (list(FUSED_MODULES) if self.fused else [])

    def module_in_out(self, module: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of PEFT target ``module`` (a fused one: its parts'
        outputs together)."""
        if module in FUSED_MODULES:
            parts = FUSED_MODULES[module]
            return self.in_out[parts[0]][0], sum(self.in_out[p][1] for p in parts)
        return self.in_out[module]

    @classmethod
    def from_hf_config(cls, cfg) -> ModelShapes:
        """Shapes of a transformers config of a family on the decoder skeleton (Llama, Qwen2/3,
        Mistral, Phi-3, Gemma 2/3, the mixture-of-experts families: their dense layers' and
        shared experts' MLP linears by layer, ``mlp``)."""
        from kvserve.model_executor.models.moe import FAMILIES, is_sparse_layer

        hidden = cfg.hidden_size
        heads = cfg.num_attention_heads
        hd = getattr(cfg, "head_dim", None) or hidden // heads
        kv = (getattr(cfg, "num_key_value_heads", None) or heads) * hd
        q = heads * hd
        inter = cfg.intermediate_size
        fam = FAMILIES.get(getattr(cfg, "model_type", ""))
        family, mlp = "", None
        if fam is not None:
            family, mlp = fam.name, {}
            shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0) if fam.shared_expert else 0
            for i in range(cfg.num_hidden_layers):
                if not is_sparse_layer(cfg, fam, i):
                    mlp[i] = ("mlp", inter)
                elif shared:
                    mlp[i] = ("mlp.shared_expert", shared)
            # in_out's MLP sizes bound every layer's (``max_weights_file_bytes``)
            inter = max([n for _, n in mlp.values()], default=inter)
        return cls(
            cfg.num_hidden_layers,
            {
                "q_proj": (hidden, q),
                "k_proj": (hidden, kv),
                "v_proj": (hidden, kv),
                "o_proj": (q, hidden),
                "gate_proj": (hidden, inter),
                "up_proj": (hidden, inter),
                "down_proj": (inter, hidden),
            },
            fused=getattr(cfg, "model_type", "") == "phi3",
            family=family,
            mlp=mlp,
        )


def _target_names(target_modules, family: str = "") -> set[str] | None:
    """The PEFT target names ``target_modules`` lists (None: a regex, checked by the weights).

    Raises:
        ValueError: a name that is neither one of ``TARGET_MODULES`` nor of ``FUSED_MODULES``
            (on a mixture-of-experts ``family``: naming it, and that its experts take none).
    """
    known = set(TARGET_MODULES) | set(FUSED_MODULES)
    if target_modules is None:
        raise ValueError("adapter_config.json: target_modules is missing.")
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return known
        if target_modules in known:
            return {target_modules}
        return None  # a regex over module names: the weight names say what it matched
    if not isinstance(target_modules, list):
        raise ValueError(
            f"adapter_config.json: target_modules must be a list of names or a string, got {target_modules!r}."
        )
    names = set()
    for t in target_modules:
        leaf = str(t).rsplit(".", 1)[-1]
        if leaf not in known:
            moe = (
                f" ({family} takes LoRA adapters on its attention, dense MLP and shared-expert "
                "linears only; its routed experts and routers take none)"
                if family
                else ""
            )
            raise ValueError(
                f"adapter_config.json: target_modules has {t!r}; supported target modules are "
                f"{sorted(known)}{moe}."
            )
        names.add(leaf)
    return names


def split_fused(
    module: str, a: torch.Tensor, b: torch.Tensor, shapes: ModelShapes
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """A LoRA on fused linear ``module`` (``FUSED_MODULES``: ``A`` ``[r, in]``, ``B``
    ``[sum of the parts' out, r]``) as one LoRA per part: ``(part, A, B's rows of the part)``.
    ``B x A`` restricted to a part's output rows is that part's rows of ``B`` times ``A``, so the
    deltas are the same. ``B`` must have the parts' total rows (the caller checked it)."""
    out, row = [], 0
    for part in FUSED_MODULES[module]:
        n = shapes.in_out[part][1]
        out.append((part, a, b[row : row + n]))
        row += n
    return out


class AdapterFileError(ValueError):
    """An adapter directory or file that is missing, not a regular file (a FIFO, a device, a
    directory), not openable, or that resolves outside the allowed root. The server answers
    these at run time with its one "not a loadable LoRA adapter" message, so that it does not
    tell which paths exist; the message here (for logs and offline use) says why."""


def _open_regular(path: str, name: str, allowed_root: str | None) -> tuple[int, os.stat_result]:
    """Open ``path/name`` for reading if it is a regular file (symlinks resolved) under
    ``allowed_root`` (when given).

    Returns:
        the open file descriptor (the caller closes it) and its ``fstat``.
    Raises:
        AdapterFileError: naming the file and why.
    """
    fpath = os.path.join(path, name)
    real = os.path.realpath(fpath)
    root = os.path.realpath(allowed_root) if allowed_root is not None else None
    if root is not None and os.path.commonpath([root, real]) != root:
        raise AdapterFileError(f"{fpath} resolves to {real!r}, outside the allowed LoRA root {root!r}.")
    # O_NONBLOCK: opening a FIFO with no writer would block; O_NOFOLLOW: the resolved path must
    # not have become a symlink since
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise AdapterFileError(f"lora_path {path!r} has no {name}.") from None
    except OSError as e:
        raise AdapterFileError(f"{fpath}: cannot be opened ({e.strerror}).") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AdapterFileError(
                f"{fpath} (resolved to {real!r}) is not a regular file (a FIFO, device or directory)."
            )
        if root is not None:
            # a directory on the way swapped for a symlink after ``realpath``: see where the
            # descriptor really points (Linux)
            try:
                opened = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                opened = real
            if os.path.commonpath([root, opened]) != root:
                raise AdapterFileError(f"{fpath} opened {opened!r}, outside the allowed LoRA root {root!r}.")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def max_weights_file_bytes(shapes: ModelShapes, max_lora_rank: int) -> int:
    """Bytes of tensor data the largest valid adapter for ``shapes`` could hold: rank
    ``max_lora_rank`` ``A`` and ``B`` for every target linear of every layer, in float64 (the
    widest float dtype). The safetensors header is not counted."""
    elems = sum(max_lora_rank * (fin + fout) for fin, fout in shapes.in_out.values())
    return shapes.num_layers * elems * 8


def _read_weights(path: str, shapes: ModelShapes, max_lora_rank: int, allowed_root: str | None) -> bytes:
    """The bytes of ``path``'s weights file, once its size is checked against its header.

    Raises:
        AdapterFileError: not a regular file (``_open_regular``).
        ValueError: a header length that does not fit the file or passes
            ``MAX_SAFETENSORS_HEADER_BYTES``, or tensor data larger than
            ``max_weights_file_bytes``, naming the file and the limit.
    """
    wpath = os.path.join(path, WEIGHTS_FILE)
    fd, st = _open_regular(path, WEIGHTS_FILE, allowed_root)
    with os.fdopen(fd, "rb") as f:
        # safetensors: an 8-byte little-endian header length, the JSON header, then the data
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{wpath}: not a readable safetensors file ({st.st_size} bytes, no header).")
        n = int.from_bytes(head, "little")
        if n > MAX_SAFETENSORS_HEADER_BYTES or 8 + n > st.st_size:
            raise ValueError(
                f"{wpath}: not a readable safetensors file (header of {n} bytes in a file of "
                f"{st.st_size}; at most {MAX_SAFETENSORS_HEADER_BYTES})."
            )
        limit = max_weights_file_bytes(shapes, max_lora_rank)
        if st.st_size - 8 - n > limit:
            raise ValueError(
                f"{wpath}: {st.st_size - 8 - n} bytes of tensor data, more than a LoRA of rank "
                f"max_lora_rank={max_lora_rank} for this model can hold ({limit} bytes)."
            )
        # bounded by the size just checked, even if the file grows meanwhile
        return head + f.read(st.st_size - 8)


def read_adapter_config(path: str, allowed_root: str | None = None, family: str = "") -> dict:
    """``adapter_config.json`` of ``path``, validated (see the module doc).

    Args:
        allowed_root: when set, the file must resolve (symlinks followed) under it.
        family: a mixture-of-experts architecture, named when a target is one of its experts.
    Raises:
        AdapterFileError: ``path`` is not a directory, or the file is missing, not a regular
            file, not openable, or outside ``allowed_root``.
        ValueError: a file larger than ``MAX_ADAPTER_CONFIG_BYTES``, not JSON, a non-LoRA
            adapter, or an unsupported field, naming the path and the field or limit.
    """
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise AdapterFileError(f"lora_path {path!r} is not a directory.")
    fd, st = _open_regular(path, CONFIG_FILE, allowed_root)
    with os.fdopen(fd, "rb") as f:
        try:
            # one byte past the limit: a file grown after the fstat is still caught
            data = b"" if st.st_size > MAX_ADAPTER_CONFIG_BYTES else f.read(MAX_ADAPTER_CONFIG_BYTES + 1)
        except OSError as e:
            raise ValueError(f"{cfg_path}: not readable ({e.strerror}).") from e
    if st.st_size > MAX_ADAPTER_CONFIG_BYTES or len(data) > MAX_ADAPTER_CONFIG_BYTES:
        raise ValueError(
            f"{cfg_path}: larger than {MAX_ADAPTER_CONFIG_BYTES} bytes, the limit for {CONFIG_FILE}."
        )
    try:
        cfg = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        # RecursionError: arrays or objects nested past the parser's depth (a hostile file
        # would otherwise end the server's load request with a 500)
        raise ValueError(f"{cfg_path}: not readable JSON ({e}).") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object.")
    ptype = cfg.get("peft_type", "LORA")
    if str(ptype).upper() != "LORA":
        raise ValueError(f"{cfg_path}: peft_type={ptype!r}; only LORA adapters are supported.")
    refused = (
        ("use_dora", lambda v: bool(v), "DoRA adapters are not supported"),
        ("bias", lambda v: v not in (None, "none"), "only bias='none' is supported"),
        ("lora_bias", lambda v: bool(v), "trained LoRA biases are not supported"),
        ("modules_to_save", lambda v: bool(v), "fully trained extra modules are not supported"),
        ("rank_pattern", lambda v: bool(v), "per-module ranks are not supported"),
        ("alpha_pattern", lambda v: bool(v), "per-module alphas are not supported"),
        ("fan_in_fan_out", lambda v: bool(v), "fan_in_fan_out layouts are not supported"),
        # PEFT options that change the forward pass beyond ``scale * B(A(x))`` on every token:
        # loading their A / B as a plain LoRA would serve other outputs without a word
        ("alora_invocation_tokens", lambda v: bool(v), "activated LoRA (aLoRA) is not supported"),
        ("layer_replication", lambda v: bool(v), "replicated layers are not supported"),
        ("use_qalora", lambda v: bool(v), "QA-LoRA adapters are not supported"),
        ("use_bdlora", lambda v: bool(v), "block-diagonal LoRA (BD-LoRA) is not supported"),
        ("trainable_token_indices", lambda v: bool(v), "trained token embeddings are not supported"),
        ("target_parameters", lambda v: bool(v), "LoRA on parameters (not linears) is not supported"),
        ("arrow_config", lambda v: bool(v), "Arrow routing is not supported"),
        ("kasa_config", lambda v: bool(v), "KaSA adapters are not supported"),
        ("monteclora_config", lambda v: bool(v), "MonteCLoRA adapters are not supported"),
    )
    if family and cfg.get("target_parameters"):
        # peft adapts a mixture-of-experts model's stacked expert weights as parameters
        raise ValueError(
            f"{cfg_path}: target_parameters={cfg['target_parameters']!r}: {family} takes LoRA "
            "adapters on its attention, dense MLP and shared-expert linears only, not on its routed "
            "experts' weights."
        )
    for key, bad, why in refused:
        if key in cfg and bad(cfg[key]):
            raise ValueError(f"{cfg_path}: {key}={cfg[key]!r}: {why}.")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{cfg_path}: r must be a positive integer, got {r!r}.")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{cfg_path}: lora_alpha must be a finite number, got {alpha!r}.")
    _target_names(cfg.get("target_modules"), family)
    return cfg


def load_peft_adapter(
    path: str,
    lora_int_id: int,
    shapes: ModelShapes,
    max_lora_rank: int,
    dtype: torch.dtype = torch.float32,
    allowed_root: str | None = None,
) -> LoRAModel:
    """Read and validate the PEFT adapter in directory ``path`` for a model of ``shapes``.

    Args:
        allowed_root: when set, each file read must resolve (symlinks followed) under it.

    Returns:
        a ``LoRAModel`` whose tensors are on CPU in ``dtype`` (the scale folded into ``B`` in
        float32 first).
    Raises:
        AdapterFileError: a missing directory or file, one that is not a regular file, or one
            outside ``allowed_root`` (naming the path).
        ValueError: an oversized config or weights file (naming the limit), a rank above
            ``max_lora_rank`` (naming it), an unsupported config field or target module, a
            weight name that is not a known LoRA weight, a shape that does not match the model,
            an ``A`` without its ``B``, a scaling (``lora_alpha / r``) beyond ``dtype``'s range,
            or a weight that is NaN/inf in ``dtype`` once scaled.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    cfg = read_adapter_config(path, allowed_root, shapes.family)
    r_cfg: int = cfg["r"]
    if r_cfg > max_lora_rank:
        raise ValueError(f"LoRA rank {r_cfg} of {path!r} is above max_lora_rank={max_lora_rank}.")
    wpath = os.path.join(path, WEIGHTS_FILE)
    try:
        data = _read_weights(path, shapes, max_lora_rank, allowed_root)
    except OSError as e:
        raise ValueError(f"{wpath}: not readable ({e.strerror}).") from e
    try:
        tensors = load(data)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{wpath}: not a readable safetensors file ({e}).") from e
    targets = _target_names(cfg.get("target_modules"), shapes.family)
    alpha = float(cfg.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(r_cfg) if cfg.get("use_rslora") else alpha / r_cfg
    if not abs(scaling) <= torch.finfo(dtype).max:
        raise ValueError(
            f"{os.path.join(path, CONFIG_FILE)}: lora_alpha={alpha!r} / r={r_cfg} gives a scaling of "
            f"{scaling:g}, which is not finite in {dtype} (largest {torch.finfo(dtype).max:g})."
        )
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        expert = _EXPERT_KEY.match(name) if shapes.family else None
        if expert is not None:
            raise ValueError(
                f"{wpath}: {name!r} targets {expert.group(1)}: {shapes.family} takes LoRA adapters "
                "on its attention, dense MLP and shared-expert linears only, not on its routed "
                "experts or routers."
            )
        m = _KEY.match(name)
        if m is None:
            raise ValueError(f"{wpath}: {name!r} is not a LoRA weight of a decoder-layer linear.")
        layer, parent, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in shapes.module_names or _PARENT[module] != parent.split(".")[0]:
            raise ValueError(
                f"{wpath}: {name!r} targets {parent}.{module}; supported target modules of this "
                f"model are {sorted(shapes.module_names)}."
            )
        if layer < shapes.num_layers and _PARENT[module] == "mlp" and parent != shapes.mlp_parent(layer):
            where = shapes.mlp_parent(layer)
            raise ValueError(
                f"{wpath}: {name!r} targets {parent}.{module}, but layer {layer} of "
                f"{shapes.family or 'this model'} has "
                + (f"its MLP linears under {where}." if where else "only routed experts (no LoRA targets).")
            )
        if targets is not None and module not in targets:
            raise ValueError(f"{wpath}: {name!r} targets {module}, which target_modules does not list.")
        if layer >= shapes.num_layers:
            raise ValueError(f"{wpath}: {name!r} is for layer {layer}; the model has {shapes.num_layers}.")
        got = parts.setdefault((layer, module), {})
        if ab in got:
            # e.g. ``...lora_A.weight`` and ``...lora_A.default.weight``: which one PEFT would
            # apply is not ours to guess
            raise ValueError(f"{wpath}: layer {layer} {module} has more than one lora_{ab} ({name!r}).")
        got[ab] = t
    if not parts:
        raise ValueError(f"{wpath}: no LoRA weights.")
    model = LoRAModel(lora_int_id=lora_int_id, rank=0, scaling=scaling, path=path)
    for (layer, module), ab in sorted(parts.items()):
        where = f"{wpath}: layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: has lora_{'A' if 'A' in ab else 'B'} without its pair.")
        a, b = ab["A"], ab["B"]
        fin, fout = (
            shapes.layer_in_out(layer, module) if module in TARGET_MODULES else shapes.module_in_out(module)
        )
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != fin
            or b.shape[0] != fout
            or a.shape[0] != b.shape[1]
        ):
            raise ValueError(
                f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
                f"model's [r, {fin}] / [{fout}, r]."
            )
        r = a.shape[0]
        if r > max_lora_rank:
            raise ValueError(f"{where}: LoRA rank {r} is above max_lora_rank={max_lora_rank}.")
        if r != r_cfg:
            raise ValueError(f"{where}: rank {r} differs from adapter_config.json r={r_cfg}.")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise ValueError(f"{where}: LoRA weights must be floating point, got {a.dtype} / {b.dtype}.")
        a_dev = a.to(dtype).contiguous()
        b_dev = (b.float() * scaling).to(dtype).contiguous()
        # a NaN/inf weight (stored, or from a scale that overflows ``dtype``) would turn every
        # logit of the request's rows into NaN: refuse it here, where it can still be named
        for ab_name, w in (("lora_A", a_dev), ("lora_B", b_dev)):
            if not bool(torch.isfinite(w).all()):
                raise ValueError(
                    f"{where}: {ab_name} is not finite in {dtype} (a NaN/inf weight, or "
                    f"lora_alpha={alpha!r} / r={r_cfg} scaling it past the dtype's range)."
                )
        split = (
            split_fused(module, a_dev, b_dev, shapes) if module in FUSED_MODULES else [(module, a_dev, b_dev)]
        )
        for part, pa, pb in split:
            if (layer, part) in model.weights:
                other = (
                    part
                    if module in FUSED_MODULES
                    else next(f for f, ps in FUSED_MODULES.items() if part in ps)
                )
                raise ValueError(f"{where}: {part} is adapted twice, by {module} and by {other}.")
            model.weights[(layer, part)] = (pa, pb.contiguous())
        model.rank = max(model.rank, r)
    return model
