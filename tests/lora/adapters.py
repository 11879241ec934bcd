"""Random-weight PEFT LoRA adapters made in the tests, and the transformers + peft reference."""

from __future__ import annotations

import copy
import json
import os

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base, path, r: int, targets, alpha: float = 16.0, rslora: bool = False, seed: int = 0):
    """Save a LoRA adapter with random ``A`` and ``B`` (peft's ``init_lora_weights=False``)
    for transformers model ``base`` (left unchanged) into directory ``path``; returns ``path``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=rslora,
        init_lora_weights=False,
        lora_dropout=0.0,
        bias="none",
    )
    model = get_peft_model(copy.deepcopy(base), cfg)
    model.save_pretrained(str(path))
    return str(path)


def peft_reference(base, path, merged: bool = False):
    """transformers ``base`` (copied) with the adapter of ``path`` (``PeftModel``; merged into
    the weights when ``merged``), in eval mode."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(base), str(path))
    if merged:
        model = model.merge_and_unload()
    return model.eval()


def write_adapter(path, config: dict, tensors: dict[str, torch.Tensor] | None) -> str:
    """A PEFT-shaped directory written by hand (``tensors`` None: no weights file)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    if tensors is not None:
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "adapter_model.safetensors")
        )
    return str(path)


def lora_tensors(num_layers: int, shapes: dict[str, tuple[int, int]], r: int, targets, seed: int = 0):
    """PEFT-named random ``lora_A`` ``[r, in]`` / ``lora_B`` ``[out, r]`` for ``targets``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(num_layers):
        for t in targets:
            parent = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            fin, fout = shapes[t]
            p = f"base_model.model.model.layers.{layer}.{parent}.{t}"
            out[f"{p}.lora_A.weight"] = torch.randn(r, fin, generator=g) * 0.1
            out[f"{p}.lora_B.weight"] = torch.randn(fout, r, generator=g) * 0.1
    return out
