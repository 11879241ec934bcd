"""LoRA steps on the one-call decode step (``cpu_decode_step._StepPlan``, ``csrc/decode_layers.c``):
a pure-decode step with rows on several adapters (different ranks and target subsets) and base
rows gives hidden states and KV-cache writes bit-identical to the per-layer native calls with
their ``add_lora`` after each GEMM, in float32 and bfloat16 (bfloat16 slots); the per-layer path
still runs where the kernel is off (``ops.NATIVE_MAX_ROWS``); a table without LoRA entries is
not given a LoRA step. (The per-layer path's deltas against a float64 reference and peft:
``test_lora_native.py``, ``test_lora_golden.py``.)"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

import numpy as np
import pytest
import torch

from kvserve.config import LoRAConfig
from kvserve.lora.manager import LoRAManager
from kvserve.lora.peft import ModelShapes
from kvserve.lora_request import LoRARequest
from kvserve.model_executor.layers import lora as ops
from kvserve.model_executor.layers.lora import LoRAMapping
from kvserve.model_executor.models import cpu_decode_step
from kvserve.ops import decode_layers
from kvserve.ops import lora as lora_kernel
from tests.lora.adapters import ALL_TARGETS, lora_tensors, write_adapter
from tests.model_executor.helpers import llama_config, make_worker, save_tiny
from tests.model_executor.test_cpu_decode_step_fused import (
    BLOCK,
    NUM_BLOCKS,
    count_fused,
    decode_inputs,
    fused_max_rows,
    run,
)

pytestmark = pytest.mark.skipif(
    not (decode_layers.available() and lora_kernel.available()),
    reason=f"no fused step or LoRA kernel: {decode_layers.failure_reason() or lora_kernel.failure_reason()}",
)

#: (rank, targets) of the three adapters: all targets, attention only, MLP and q only
ADAPTERS = ((8, ALL_TARGETS), (3, ["k_proj", "v_proj", "o_proj"]), (5, ["q_proj", "gate_proj", "down_proj"]))


@functools.cache
def lora_worker(dtype: str):
    """A worker on a tiny 2-layer model with a LoRA manager (3 slots, rank <= 8) holding the
    three ``ADAPTERS`` in slots; returns ``(worker, {lora_int_id: slot})``."""
    cfg = llama_config(
        hidden_size=256,
        intermediate_size=384,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=512,
    )
    path = tempfile.mkdtemp(prefix="kvserve-lora-fused-")
    atexit.register(shutil.rmtree, path, True)
    save_tiny(path, cfg, seed=5)
    # float weights on the panels wherever the kernels built (AVX2 hosts too): the one-call step
    w = make_worker(path, block_size=BLOCK, num_gpu_blocks=NUM_BLOCKS, native=True, dtype=dtype, panels=True)
    shapes = ModelShapes.from_hf_config(w.hf_config)
    mgr = LoRAManager(w.runner.model, LoRAConfig(3, 8, 3), shapes)
    reqs = []
    for i, (r, targets) in enumerate(ADAPTERS):
        d = write_adapter(
            f"{path}/a{i}",
            {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets)},
            lora_tensors(cfg.num_hidden_layers, shapes.in_out, r, targets, seed=i),
        )
        reqs.append(LoRARequest(f"a{i}", i + 1, d))
    return w, mgr.activate(reqs)


def lora_step(dtype: str, rows: int, seed: int):
    """A pure-decode step of ``rows`` rows, each on a random adapter slot or the base model."""
    w, slots = lora_worker(dtype)
    inp = decode_inputs(w, rows, seed)
    rng = np.random.default_rng(seed)
    row_slots = rng.choice([-1, *slots.values()], size=rows)
    row_slots[0] = next(iter(slots.values()))  # at least one LoRA row
    inp.attn.lora = LoRAMapping.build(row_slots)
    return w, inp


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 21])
def test_fused_lora_step_bit_identical_to_per_layer_calls(dtype, rows):
    """16 rows: the one-call step takes them on every CPU; 21 (three 8-row chunks of a slot)
    only where the CPU's bfloat16 GEMM stays native past 16 rows (``fused_max_rows``)."""
    w, inp = lora_step(dtype, rows, seed=rows)
    limit, why = fused_max_rows(w.runner.model)
    if limit is not None and rows > limit:
        pytest.skip(f"no one-call step at {rows} rows on this CPU ({why})")
    assert cpu_decode_step.applies(w.runner.model, w.cache_engine.gpu_cache, inp.attn, rows)
    with count_fused() as calls:
        got, got_cache = run(w, inp, fused=True)
    want, want_cache = run(w, inp, fused=False)
    assert calls == [rows]  # the one-call step ran, with the LoRA rows
    assert torch.equal(got, want)
    for g, c in zip(got_cache, want_cache):
        assert torch.equal(g, c)
    # and the adapters did something: the same step without them differs
    inp.attn.lora = None
    base, _ = run(w, inp, fused=True)
    assert not torch.equal(got, base)


def test_lora_step_keeps_the_per_layer_path_where_the_kernel_is_off(monkeypatch):
    """``ops.NATIVE_MAX_ROWS`` below the step (the torch forms forced): per-layer path, and the
    same hidden states as with the kernel within float tolerance."""
    w, inp = lora_step("float32", 5, seed=2)
    want, _ = run(w, inp, fused=False)
    monkeypatch.setattr(ops, "NATIVE_MAX_ROWS", 0)
    with count_fused() as calls:
        got, _ = run(w, inp, fused=True)
    assert calls == []
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_plan_without_lora_entries_refuses_a_lora_mapping():
    """A plan built for a model without slots has no LoRA entries: forward_layers does not pick
    it for a LoRA step, and ``run`` refuses one rather than drop the deltas."""
    w, inp = lora_step("float32", 2, seed=3)
    plan = cpu_decode_step.step_plan(w.runner.model, 2, w.cache_engine.gpu_cache)
    assert plan is not None and plan.has_lora
    bare = cpu_decode_step._StepPlan.__new__(cpu_decode_step._StepPlan)
    bare.has_lora, bare.struct = False, plan.struct
    with pytest.raises(ValueError, match="LoRA mapping"):
        bare.run(torch.zeros(2, 256), None, None, None, None, inp.attn.lora)
