"""Where adapters live: a CPU LRU of loaded adapters and ``max_loras`` device slots.

Device slots are stacked tensors per decoder layer and fused target linear (``qkv``, ``o``,
``gate_up``, ``down``): ``A`` ``[max_loras, in, parts * max_lora_rank]`` and ``B``
``[max_loras, parts * max_lora_rank, out]``, zero-padded (``A`` stored slot by slot where the
native kernel runs, so that it streams one contiguous block per slot; elsewhere stored
``[in, max_loras, ...]`` so that all slots side by side are one matrix for the torch stacked
form: ``kvserve.model_executor.layers.lora.stacked_views``), in the model's dtype (float32 on CPU
for a float16 model, and for a bfloat16 one without the native kernel:
``kvserve.model_executor.layers.lora.lora_slot_dtype``). A fused linear's part ``i`` (q, k, v
of ``qkv``; gate, up of ``gate_up``) owns rank columns ``[i * max_lora_rank, ...)`` of ``A``
and, in ``B``, those rank rows times its own output columns (block-diagonal), so one shrink and
one expand per slot give every part's delta in its column range of the fused output. A part
the adapter does not target stays zero.

``activate`` gives every adapter of a step a slot (at most ``max_loras`` distinct ones: the
scheduler's guarantee), keeping adapters already in a slot and replacing the least recently
used others. The CPU cache holds up to ``max_cpu_loras`` adapters, least recently used evicted
first; an adapter evicted there but asked for again is read from its directory once more.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from kvserve.config import LoRAConfig
from kvserve.lora.peft import LoRAModel, ModelShapes, load_peft_adapter
from kvserve.lora_request import LoRARequest
from kvserve.model_executor.layers.lora import lora_slot_dtype
from kvserve.ops import lora as lora_kernel

logger = logging.getLogger("kvserve.lora")

#: fused target -> its PEFT parts in column order.
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class LoRAManager:
    """CPU cache + device slots of LoRA adapters for one model.

    Args:
        model: a ``LlamaForCausalLM``; its attention and MLP modules get ``lora_stacks``
            (fused target -> ``(A, B)``) pointing at the slot tensors, and ``lora_parts``
            (fused target -> its parts' output column bounds, ``part_bounds``).
        lora_config: the limits (``max_loras``, ``max_lora_rank``, ``max_cpu_loras``).
        shapes: the model's linear shapes (``ModelShapes.from_hf_config``).

    Attributes:
        last_load_s: seconds the last adapter read from disk took.
        num_slot_loads, slot_load_s: device slot fills so far and the seconds they took in
            all (copies from the CPU cache, plus any disk read they needed).
    """

    def __init__(self, model, lora_config: LoRAConfig, shapes: ModelShapes):
        self.config = lora_config
        self.shapes = shapes
        self.dtype = model.dtype  # adapters are validated (and cached on CPU) in it
        self.device = model.embed_tokens.device
        if torch.device(self.device).type == "cpu":
            lora_kernel.available()  # build the op's kernel now, not inside the first step
        # the slots' dtype: the model's, or float32 on CPU where only torch computes them
        # (``lora_slot_dtype``)
        self.slot_dtype = lora_slot_dtype(self.dtype, self.device)
        self.max_loras = lora_config.max_loras
        self.rmax = lora_config.max_lora_rank
        self._cpu: OrderedDict[int, tuple[LoRARequest, LoRAModel]] = OrderedDict()
        self._slots: list[LoRARequest | None] = [None] * self.max_loras  # what each slot holds
        self._slot_used: list[float] = [0.0] * self.max_loras
        self._use_counter = 0.0
        self.last_load_s = 0.0
        self.num_slot_loads = 0
        self.slot_load_s = 0.0
        self._model = model
        # (layer, part) -> (fused target, part index, column offset in the fused output);
        # layer -> fused target -> its parts' output column bounds (the op skips B's zero
        # blocks). Layers differ only in a mixture-of-experts family (dense, shared-expert
        # and expert-only MLPs: ``ModelShapes.mlp``).
        self._offsets: dict[tuple[int, str], tuple[str, int, int]] = {}
        self.part_bounds: list[dict[str, tuple[int, ...]]] = []
        for layer in range(len(model.layers)):
            bounds: dict[str, tuple[int, ...]] = {}
            for fused, parts in self.layer_targets(shapes, layer).items():
                cols = [0]
                for i, p in enumerate(parts):
                    self._offsets[(layer, p)] = (fused, i, cols[-1])
                    cols.append(cols[-1] + shapes.layer_in_out(layer, p)[1])
                bounds[fused] = tuple(cols)
            self.part_bounds.append(bounds)
        S, R = self.max_loras, self.rmax
        #: A stored slot by slot ([S, in, w]: one slot's A one contiguous block, the native
        #: kernel's stream) where the kernel runs, else [in, S, w] (the torch stacked form's
        #: all-slots view); handed out as [S, in, w] either way
        self.slot_major_a = torch.device(self.device).type == "cpu" and lora_kernel.available()
        # every slot is allocated (and zeroed) now: refuse limits whose slots cannot fit, by
        # name, instead of leaving it to the allocator or the OOM killer
        need = S * self.slot_bytes(shapes, R, self.slot_dtype)
        free = _free_memory_bytes(self.device)
        if free is not None and need > free:
            raise ValueError(
                f"max_loras={S} with max_lora_rank={R} needs {need} bytes of LoRA slots "
                f"({self.slot_bytes(shapes, R, self.slot_dtype)} per slot), but only {free} bytes are "
                f"free on {self.device}; lower max_loras or max_lora_rank."
            )
        self.stacks = self._zero_stacks(S)
        self._attach(self.stacks)
        for i, bounds in enumerate(self.part_bounds):
            for module, keys in self._modules(i):
                module.lora_parts = {k: bounds[k] for k in keys}

    @staticmethod
    def layer_targets(shapes: ModelShapes, layer: int) -> dict[str, tuple[str, ...]]:
        """The fused targets of decoder layer ``layer`` and their parts: all of
        ``FUSED_PARTS``, less gate/up and down in a mixture-of-experts layer with only routed
        experts (``ModelShapes.mlp_parent``)."""
        if shapes.mlp_parent(layer) is not None:
            return FUSED_PARTS
        return {k: v for k, v in FUSED_PARTS.items() if k in ("qkv", "o")}

    def _modules(self, layer: int) -> list[tuple[Any, tuple[str, ...]]]:
        """``(module, fused targets)`` that take layer ``layer``'s LoRA: its attention, and the
        MLP the model names (``lora_mlp``: a dense MLP or a shared expert) where it has one."""
        m = self._model
        out: list[tuple[Any, tuple[str, ...]]] = [(m.layers[layer].self_attn, ("qkv", "o"))]
        mlp = m.lora_mlp(layer) if hasattr(m, "lora_mlp") else m.layers[layer].mlp
        if mlp is not None and self.shapes.mlp_parent(layer) is not None:
            out.append((mlp, ("gate_up", "down")))
        return out

    def _zero_stacks(self, num_slots: int) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Zeroed per-layer slot stacks of ``num_slots`` slots (the class doc's layout)."""
        stacks = []
        R = self.rmax
        kw = {"dtype": self.slot_dtype, "device": self.device}
        for layer in range(len(self._model.layers)):
            st = {}
            for fused, parts in self.layer_targets(self.shapes, layer).items():
                fin = self.shapes.layer_in_out(layer, parts[0])[0]
                fout = sum(self.shapes.layer_in_out(layer, p)[1] for p in parts)
                w = len(parts) * R
                if self.slot_major_a:
                    a = torch.zeros(num_slots, fin, w, **kw)
                else:  # [in, S, w] storage: every slot's A side by side, [in, S * w], is a view
                    a = torch.zeros(fin, num_slots, w, **kw).permute(1, 0, 2)
                st[fused] = (a, torch.zeros(num_slots, w, fout, **kw))
            stacks.append(st)
        return stacks

    def _attach(self, stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Point the model's attention and MLP modules at ``stacks``."""
        for i, st in enumerate(stacks):
            for module, keys in self._modules(i):
                module.lora_stacks = {k: st[k] for k in keys}

    @staticmethod
    def slot_bytes(shapes: ModelShapes, max_lora_rank: int, dtype: torch.dtype) -> int:
        """Bytes one device slot takes: ``A`` ``[in, parts * R]`` and ``B`` ``[parts * R, out]``
        of every fused target in every layer, in ``dtype`` (the slot dtype: ``lora_slot_dtype``)."""
        total = 0
        for layer in range(shapes.num_layers):
            for parts in LoRAManager.layer_targets(shapes, layer).values():
                fin = shapes.layer_in_out(layer, parts[0])[0]
                fout = sum(shapes.layer_in_out(layer, p)[1] for p in parts)
                total += len(parts) * max_lora_rank * (fin + fout)
        return total * torch.empty(0, dtype=dtype).element_size()

    # ------------------------------------------------------------------ CPU cache
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load ``lora_request``'s adapter into the CPU cache (validated) unless it is there.

        Returns:
            True when it was read now, False when it was already loaded.
        Raises:
            ValueError: the adapter is invalid (``load_peft_adapter``), a probe forward with
                it breaks the model's outputs (``_probe``), or its ``lora_int_id`` is loaded
                from another path or under another name.
        """
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}.")
        have = self._cpu.get(lora_request.lora_int_id)
        if have is not None:
            known = have[0]
            if (known.lora_path, known.lora_name) != (lora_request.lora_path, lora_request.lora_name):
                raise ValueError(
                    f"lora_request.lora_int_id={lora_request.lora_int_id} is already loaded as "
                    f"{known.lora_name!r} from {known.lora_path!r}; use another id for "
                    f"{lora_request.lora_name!r} ({lora_request.lora_path!r})."
                )
            self._cpu.move_to_end(lora_request.lora_int_id)
            return False
        t = time.perf_counter()
        model = load_peft_adapter(
            lora_request.lora_path,
            lora_request.lora_int_id,
            self.shapes,
            self.rmax,
            self.dtype,
            allowed_root=lora_request.allowed_root,
        )
        self._probe(lora_request, model)
        self.last_load_s = time.perf_counter() - t
        # a slot may still hold this id from before a CPU eviction, perhaps from another path:
        # it is refilled from the new copy when next needed
        for s, held in enumerate(self._slots):
            if held is not None and held.lora_int_id == lora_request.lora_int_id:
                self._clear_slot(s)
        self._cpu[lora_request.lora_int_id] = (lora_request, model)
        max_cpu = self.config.max_cpu_loras or self.max_loras
        while len(self._cpu) > max_cpu:
            evicted, _ = self._cpu.popitem(last=False)
            logger.info("LoRA %d evicted from the CPU cache (max_cpu_loras=%d)", evicted, max_cpu)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the CPU cache and its device slot (zeroed); False when it was
        not loaded."""
        found = self._cpu.pop(lora_int_id, None) is not None
        for s, held in enumerate(self._slots):
            if held is not None and held.lora_int_id == lora_int_id:
                self._clear_slot(s)
                found = True
        return found

    @torch.inference_mode()
    def _clear_slot(self, slot: int) -> None:
        """Mark ``slot`` free and zero its weights: the stacked op multiplies every slot below
        the highest active one, so a freed slot must hold exactly zeros, not its last adapter."""
        self._slots[slot] = None
        for st in self.stacks:
            for a, b in st.values():
                a[slot].zero_()
                b[slot].zero_()

    def list_loras(self) -> set[int]:
        """Ids of the adapters loaded (CPU cache or a device slot)."""
        return set(self._cpu) | {r.lora_int_id for r in self._slots if r is not None}

    def slot_of(self, lora_int_id: int) -> int | None:
        """The device slot holding ``lora_int_id`` now, or None."""
        for s, held in enumerate(self._slots):
            if held is not None and held.lora_int_id == lora_int_id:
                return s
        return None

    # ------------------------------------------------------------------ device slots
    def activate(self, lora_requests: list[LoRARequest]) -> dict[int, int]:
        """Give each distinct adapter of a step a device slot (loading it when needed).

        Returns:
            ``lora_int_id`` -> slot.
        Raises:
            RuntimeError: more than ``max_loras`` distinct adapters (the scheduler never
                schedules that).
            ValueError: an adapter that has to be read again no longer validates.
        """
        wanted: dict[int, LoRARequest] = {}
        for r in lora_requests:
            wanted.setdefault(r.lora_int_id, r)
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step has {len(wanted)} distinct LoRA adapters; max_loras={self.max_loras}")
        self._use_counter += 1
        out: dict[int, int] = {}
        missing = []
        for lid in wanted:
            s = self.slot_of(lid)
            if s is not None and self._slots[s] != wanted[lid]:
                # the slot holds this id from another path (the CPU copy was evicted and the
                # id reused): refill it, and let add_lora refuse a conflict it still knows of
                self._slots[s] = None
                s = None
            if s is None:
                missing.append(lid)
            else:
                out[lid] = s
                self._slot_used[s] = self._use_counter
        for lid in missing:
            free = [s for s in range(self.max_loras) if self._slots[s] is None]
            if free:
                s = free[0]
            else:  # the least recently used slot this step does not need
                s = min(
                    (s for s in range(self.max_loras) if self._slot_used[s] < self._use_counter),
                    key=lambda s: self._slot_used[s],
                )
            self._load_slot(s, wanted[lid])
            out[lid] = s
            self._slot_used[s] = self._use_counter
        return out

    @torch.inference_mode()
    def _load_slot(self, slot: int, req: LoRARequest) -> None:
        t = time.perf_counter()
        self._clear_slot(slot)  # (not valid while half-written)
        self.add_lora(req)
        _, model = self._cpu[req.lora_int_id]
        self._copy_into(self.stacks, slot, model)
        self._slots[slot] = req
        self.num_slot_loads += 1
        self.slot_load_s += time.perf_counter() - t

    def _copy_into(self, stacks, slot: int, model: LoRAModel) -> None:
        """Copy ``model``'s weights into (zeroed) slot ``slot`` of ``stacks``: each part's
        rank columns of ``A`` and its rank rows times output columns of ``B``."""
        R = self.rmax
        for (layer, part), (la, lb) in model.weights.items():
            fused, i, col = self._offsets[(layer, part)]
            a, b = stacks[layer][fused]
            r = la.shape[0]
            a[slot, :, i * R : i * R + r].copy_(la.t())
            b[slot, i * R : i * R + r, col : col + lb.shape[0]].copy_(lb.t())

    #: Tokens of the probe forward every adapter passes when it is read (``_probe``).
    PROBE_TOKENS = 8

    @torch.inference_mode()
    def _probe_fault(self, model: LoRAModel | None) -> str | None:
        """Why a probe forward through the model with ``model``'s adapter on every row (None:
        the base model) is broken, or None when it is sound.

        The probe is a fixed prompt of ``PROBE_TOKENS`` token ids (drawn from a fixed seed), a
        fresh prefill without a KV cache. Broken: a NaN/inf logit, or a residual stream whose
        mean square (float32, per row) is not finite at some RMS norm -- there the norm scales
        it by ``rsqrt(inf) = 0`` and every later value, the logits included, is zeros: finite
        but meaningless. The adapter sits in a one-slot stack of its own, attached for this
        forward only: the device slots are not touched.
        """
        from kvserve.model_executor.layers.attention import AttentionMetadata, PrefillChunk
        from kvserve.model_executor.layers.lora import LoRAMapping
        from kvserve.model_executor.layers.rmsnorm import OffsetRMSNorm, RMSNorm

        m = self._model
        T = self.PROBE_TOKENS
        vocab = int(m.config.vocab_size)
        ids = torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(0)).to(self.device)
        positions = torch.arange(T, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(write_idx=None, prefills=[PrefillChunk(0, T, 0)], num_prefill_tokens=T)
        # a family whose layers differ in window (Gemma) looks up each layer's variant; plain
        # causal masks in all: the probe judges finiteness, not the values
        for w in {int(w or 0) for w in getattr(m, "layer_windows", None) or ()} - {0}:
            meta.windowed[w] = AttentionMetadata(
                write_idx=None, prefills=[PrefillChunk(0, T, 0)], num_prefill_tokens=T, window=w
            )
        overflowed: list[bool] = []

        def check_norm_input(_mod, inputs, _out):
            # with a residual the norm adds x into it in place and normalizes the sum
            src = inputs[1] if len(inputs) > 1 and inputs[1] is not None else inputs[0]
            if not overflowed and not bool(torch.isfinite(src.float().pow(2).mean(-1)).all()):
                overflowed.append(True)

        hooks = [
            mod.register_forward_hook(check_norm_input)
            for mod in m.modules()
            if isinstance(mod, (RMSNorm, OffsetRMSNorm))
        ]
        probe = None
        if model is not None:
            probe = self._zero_stacks(1)
            self._copy_into(probe, 0, model)
            meta.lora = LoRAMapping.build(np.zeros(T, dtype=np.int64), self.device)
            for variant in meta.windowed.values():
                variant.lora = meta.lora
            self._attach(probe)
        try:
            logits = m.compute_logits(m(ids, positions, None, meta))
        finally:
            for h in hooks:
                h.remove()
            if probe is not None:
                self._attach(self.stacks)
        if not bool(torch.isfinite(logits).all()):
            return "non-finite logits (NaN or inf)"
        if overflowed:
            return (
                "a residual stream too large to normalize (its mean square overflows float32 at an RMS norm)"
            )
        return None

    def _probe(self, req: LoRARequest, model: LoRAModel) -> None:
        """Refuse an adapter whose weights are finite but break the model's forward (huge
        weights or ``lora_alpha``: the deltas overflow in attention or the residual stream).

        A base model that fails the probe by itself gives no verdict on the adapter: it is
        accepted with a warning (the sampler still fails any request whose logits are not
        finite).

        Raises:
            ValueError: naming the adapter and the fault, when the probe forward with it is
                broken (``_probe_fault``) and the base model's is not.
        """
        fault = self._probe_fault(model)
        if fault is None:
            return
        base = self._probe_fault(None)
        if base is not None:
            logger.warning(
                "LoRA adapter %r not probed: the base model alone gives %s on the probe prompt",
                req.lora_name,
                base,
            )
            return
        raise ValueError(
            f"LoRA adapter {req.lora_name!r} ({req.lora_path!r}): a probe forward of "
            f"{self.PROBE_TOKENS} tokens through the model with it gives {fault} (the base model's "
            f"does not); its weights or scaling (lora_alpha / r = {model.scaling:g}) are too large."
        )


def _free_memory_bytes(device: torch.device | str) -> int | None:
    """Free memory on ``device`` (CPU: available RAM; CUDA: free device memory), or None
    when it cannot be told."""
    try:
        if torch.device(device).type == "cuda":
            return int(torch.cuda.mem_get_info(torch.device(device))[0])
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # unknown: let the allocation decide
        return None
