"""Test-side writers of GPTQ, AWQ and compressed-tensors checkpoints, written from the formats'
descriptions (independently of ``kvserve.model_executor.quantized_checkpoint``'s readers).

``quantize_dir`` takes a tiny float HF model, replaces its linear weights by random quantized
ones in the chosen format, and writes two directories: the quantized checkpoint and a float
checkpoint holding exactly the quantized weights dequantized (float64 -> float32), the
reference transformers runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_along_rows(vals: np.ndarray, bits: int = 4) -> np.ndarray:
    """int32 ``[R / p, C]`` (``p = 32 / bits``): value of row ``p*r + i`` in bits
    ``bits*i ..`` of word ``r``."""
    p = 32 // bits
    v = vals.astype(np.uint32).reshape(-1, p, vals.shape[1])
    word = np.zeros((v.shape[0], v.shape[2]), dtype=np.uint32)
    for i in range(p):
        word |= v[:, i, :] << np.uint32(bits * i)
    return word.view(np.int32)


def pack_along_cols(vals: np.ndarray, order=None, bits: int = 4) -> np.ndarray:
    """int32 ``[R, C / p]``: field ``i`` of word ``c`` holds column ``p*c + order[i]``."""
    p = 32 // bits
    order = order or tuple(range(p))
    v = vals.astype(np.uint32).reshape(vals.shape[0], -1, p)
    word = np.zeros(v.shape[:2], dtype=np.uint32)
    for i in range(p):
        word |= v[:, :, order[i]] << np.uint32(bits * i)
    return word.view(np.int32)


def random_4bit(rng, out_f: int, in_f: int, group_size: int, sym: bool, perm=None, bits: int = 4):
    """Random ``bits``-bit codes ``[out, in]``, float16 scales and zeros ``[groups, out]``,
    ``g_idx`` ``[in]`` (act-order when ``perm`` is given: channel ``perm[j]`` in group
    ``j // gs``)."""
    gs = in_f if group_size == -1 else group_size
    groups = -(-in_f // gs)
    top = 1 << bits
    codes = rng.integers(0, top, (out_f, in_f))
    scales = (rng.uniform(0.5, 1.5, (groups, out_f)) * 0.16 / top).astype(np.float16)
    zeros = np.full((groups, out_f), top // 2) if sym else rng.integers(0, top, (groups, out_f))
    if perm is None:
        g_idx = np.arange(in_f) // gs
    else:
        g_idx = np.empty(in_f, dtype=np.int64)
        g_idx[perm] = np.arange(in_f) // gs
    return codes, scales, zeros, g_idx


def dequant_4bit(codes, scales, zeros, g_idx) -> np.ndarray:
    """float64 ``[out, in]``: ``scale[g, o] * (q[o, i] - zero[g, o])`` with ``g = g_idx[i]``."""
    s = scales.astype(np.float64)[g_idx].T  # [out, in]
    z = zeros.astype(np.float64)[g_idx].T
    return s * (codes - z)


def gptq_tensors(codes, scales, zeros, g_idx, v2: bool = False, bits: int = 4) -> dict[str, torch.Tensor]:
    """``qweight`` / ``qzeros`` / ``scales`` / ``g_idx`` of one module (v1 stores zero - 1, so
    its zeros must lie in ``[1, 15]``)."""
    stored = zeros if v2 else (zeros - 1) & ((1 << bits) - 1)
    return {
        "qweight": torch.from_numpy(pack_along_rows(codes.T.copy(), bits)),
        "qzeros": torch.from_numpy(pack_along_cols(stored, bits=bits)),
        "scales": torch.from_numpy(scales.copy()),
        "g_idx": torch.from_numpy(g_idx.astype(np.int32)),
    }


def awq_tensors(codes, scales, zeros) -> dict[str, torch.Tensor]:
    return {
        "qweight": torch.from_numpy(pack_along_cols(codes.T.copy(), AWQ_ORDER)),
        "qzeros": torch.from_numpy(pack_along_cols(zeros, AWQ_ORDER)),
        "scales": torch.from_numpy(scales.copy()),
    }


def _write(path: Path, config: dict, tensors: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


def quantize_dir(
    hf_model,
    qdir: Path,
    fdir: Path,
    method: str,
    seed: int = 0,
    group_size: int = 128,
    sym: bool = True,
    desc_act: bool = False,
    shared_perm: bool = True,
    v2: bool = False,
    quantize_lm_head: bool = False,
    scale_dtype=torch.float16,
    ct_strategy: str = "channel",
    ct_type: str = "int",
    extra_config: dict | None = None,
    bits: int = 4,
):
    """Write ``qdir`` (``method``: gptq / awq / compressed-tensors) and its dequantized float
    twin ``fdir`` from ``hf_model`` (a tiny float transformers model); returns the float
    ``{name: tensor}`` written to ``fdir``."""
    rng = np.random.default_rng(seed)
    sd = {k: v.detach().clone().float() for k, v in hf_model.state_dict().items()}
    qt: dict[str, torch.Tensor] = {}
    prefixes = [k[: -len(".weight")] for k in sd if k.endswith(".weight") and k.split(".")[-2] in LINEARS]
    if quantize_lm_head:
        prefixes.append("lm_head")
    perms: dict = {}
    for p in prefixes:
        w = sd[p + ".weight"]
        out_f, in_f = w.shape
        if method in ("gptq", "awq"):
            perm = None
            if desc_act:
                key = (p.rsplit(".", 1)[0], in_f) if shared_perm else p
                perm = perms.setdefault(key, rng.permutation(in_f))
            codes, scales, zeros, g_idx = random_4bit(rng, out_f, in_f, group_size, sym, perm, bits)
            if method == "gptq" and not v2:
                zeros = np.maximum(zeros, 1)  # v1 stores zero - 1 in 4 bits: 0 cannot be stored
            sd[p + ".weight"] = torch.from_numpy(dequant_4bit(codes, scales, zeros, g_idx)).float()
            parts = (
                gptq_tensors(codes, scales, zeros, g_idx, v2, bits)
                if method == "gptq"
                else awq_tensors(codes, scales, zeros)
            )
            qt.update({f"{p}.{k}": v for k, v in parts.items()})
        else:
            if ct_type == "float":
                scale = torch.from_numpy(rng.uniform(0.5, 1.5, (out_f, 1)) * 1e-3).to(scale_dtype)
                wq = (torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 40).to(
                    torch.float8_e4m3fn
                )
                deq = wq.double() * scale.double()
            else:
                q = torch.from_numpy(rng.integers(-127, 128, (out_f, in_f))).to(torch.int8)
                if ct_strategy == "group":
                    scale = torch.from_numpy(rng.uniform(0.5, 1.5, (out_f, in_f // 32)) * 2e-4).to(
                        scale_dtype
                    )
                    deq = q.double() * scale.double().repeat_interleave(32, dim=1)
                elif ct_strategy == "tensor":
                    scale = torch.tensor([2e-4]).to(scale_dtype)
                    deq = q.double() * scale.double()
                else:
                    scale = torch.from_numpy(rng.uniform(0.5, 1.5, (out_f, 1)) * 2e-4).to(scale_dtype)
                    deq = q.double() * scale.double()
                wq = q
            sd[p + ".weight"] = deq.float()
            qt[p + ".weight"] = wq
            qt[p + ".weight_scale"] = scale
    for k, v in sd.items():
        if not any(k == p + ".weight" for p in prefixes):
            qt[k] = v
    cfg = hf_model.config.to_dict()
    _write(fdir, cfg, sd)
    if method == "gptq":
        qc = {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "desc_act": desc_act,
            "sym": sym,
            "checkpoint_format": "gptq_v2" if v2 else "gptq",
        }
    elif method == "awq":
        qc = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
        }
    else:
        weights = {
            "num_bits": 8,
            "type": ct_type,
            "symmetric": True,
            "strategy": ct_strategy,
            "group_size": 32 if ct_strategy == "group" else None,
            "dynamic": False,
        }
        fmt = "float-quantized" if ct_type == "float" else "int-quantized"
        qc = {
            "quant_method": "compressed-tensors",
            "format": fmt,
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": None,
                    "format": fmt,
                }
            },
            "ignore": ["lm_head"],
            "quantization_status": "compressed",
        }
    qc.update(extra_config or {})
    _write(qdir, {**cfg, "quantization_config": qc}, qt)
    return sd
