"""Engine configuration: model, KV cache, scheduler. Validated at construction.

Every invalid value raises ``ValueError`` naming the field and the allowed range.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

#: Values of ``quantization``. ``None`` (unset): a ``.gguf`` file named as ``model`` runs its own
#: quantized blocks where the rest of the configuration allows (``EngineArgs.resolve_quantization``),
#: other models their float weights or a quantized checkpoint's own format; ``"none"``: float
#: weights (a GGUF dequantized), the same as ``None`` everywhere past that choice.
QUANTIZATION_CHOICES = ("none", "gguf", "int8", "int4", "gptq", "awq", "compressed-tensors")

#: Values of ``model_impl`` (vLLM's names): ``auto`` runs an architecture's native family
#: (``model_executor.models.registry``) where there is one, else the transformers fallback;
#: ``native`` refuses an architecture without a native family; ``transformers`` runs the fallback
#: even where a native family exists (to compare the two).
MODEL_IMPL_CHOICES = ("auto", "native", "transformers")
#: ``model_impl`` spellings of vLLM accepted for kvserve's names (vLLM's own implementations are
#: what kvserve's native families are).
MODEL_IMPL_ALIASES = {"vllm": "native"}

#: What the transformers fallback cannot run, as ``(setting, why)`` for its error messages.
FALLBACK_LIMITS = {
    "quantization": "it runs the checkpoint's float weights only",
    "tensor_parallel_size": "its modules are not sharded",
    "enable_lora": "adapters apply to the native families' fused linear weights only",
}


def fallback_conflict_error(setting: str, where: str = "") -> ValueError:
    """The ``ValueError`` for a setting the transformers fallback cannot run: ``setting`` as
    typed (``"tensor_parallel_size=2"``), its ``FALLBACK_LIMITS`` reason; ``where``: why the
    fallback was chosen (``"model_impl='transformers'"`` or the checkpoint's architecture)."""
    key = setting.split("=")[0]
    chosen = f" ({where})" if where else ""
    return ValueError(
        f"{setting} is not supported by the transformers fallback{chosen}: {FALLBACK_LIMITS[key]}; "
        "use a model with a native family and model_impl='auto' or 'native'."
    )


def _gguf_conflict_error(setting: str, why: str) -> ValueError:
    return ValueError(
        f"{setting} is not supported with quantization='gguf' ({why}); use "
        "quantization='none' (or leave it unset) to run the GGUF dequantized to float."
    )


class QuantizationChoice(NamedTuple):
    """What ``EngineArgs.resolve_quantization`` decided.

    Attributes:
        quantization: the value the worker runs (``ModelConfig.quantization``): ``"gguf"`` for a
            GGUF's own blocks, ``None`` for float weights (or a quantized checkpoint's own
            format), else the method asked for. Never ``"none"``.
        gguf_float_reason: set when the model is a GGUF run dequantized to float: why (for the
            start-up log line), else ``None``.
    """

    quantization: str | None
    gguf_float_reason: str | None


def is_gguf_path(model: str | None) -> bool:
    """Whether ``model`` is an explicit path to an existing ``*.gguf`` file (the default model,
    ``None`` / ``"default"``, is not)."""
    import os

    if model is None or model == "default":
        return False
    path = os.path.expanduser(model)
    return path.lower().endswith(".gguf") and os.path.isfile(path)


#: Step budget (tokens) of chunked prefill when none is given (vLLM V0's default).
CHUNKED_PREFILL_TOKENS = 512
#: Step budget (tokens) of the CPU default: chunked prefill (see ``EngineArgs.create_configs``).
CPU_CHUNKED_PREFILL_TOKENS = 2048
#: ... and under the ``fair`` policy: a tenant returning to a flood waits for the step in
#: flight, which no policy can stop, so steps stay short (see ``EngineArgs.create_configs``).
FAIR_CPU_CHUNKED_PREFILL_TOKENS = 256


class PreemptionMode(enum.Enum):
    """How a running group gives up its KV blocks when the cache is full.

    SWAP: copy its blocks to CPU swap space and back when resumed.
    RECOMPUTE: drop its blocks; on resume, prefill prompt + generated tokens again.
    AUTO: per victim, whichever of the two an injected cost function prices lower
    (``kvserve.core.preemption``); the scheduler also picks cheaper victims near the tail.
    (Kwon et al., "Efficient Memory Management for LLM Serving with PagedAttention", SOSP'23, §4.5.)
    """

    SWAP = enum.auto()
    RECOMPUTE = enum.auto()
    AUTO = enum.auto()


def _check_utilization(value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {value!r}.")


#: ``dtype`` spellings of vLLM (and torch) accepted for kvserve's names.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
#: ``kv_cache_dtype`` values (vLLM's names): ``auto`` stores K/V in the model dtype; ``int8``,
#: ``fp8_e4m3`` (= ``fp8``) and ``fp8_e5m2`` store one byte per value plus a scale per token and
#: KV head (``model_executor.layers.kv_quant``).
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


def check_kv_cache_dtype(value) -> str:
    """``value`` if it is one of ``KV_CACHE_DTYPES``, with ``fp8`` spelled ``fp8_e4m3``.

    Raises:
        ValueError: any other value, naming ``--kv-cache-dtype`` and the accepted ones.
    """
    if value not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype (kv_cache_dtype) must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}."
        )
    return "fp8_e4m3" if value == "fp8" else str(value)


def check_model_impl(value) -> None:
    """Raises ValueError naming ``model_impl`` and its choices when ``value`` is not one."""
    if value not in MODEL_IMPL_CHOICES:
        raise ValueError(f"model_impl must be one of {'|'.join(MODEL_IMPL_CHOICES)}, got {value!r}.")


def _json_object(name: str, value: Any) -> dict[str, Any]:
    """``value`` (None, a dict, or a JSON string of an object) as a new dict ({} for None).

    Raises:
        ValueError: not valid JSON, or not an object (naming ``name``).
    """
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}.") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}.")
    return dict(value)


def _positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")


def _positive_float(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")


def check_non_negative(name: str, value) -> None:
    """Raises ValueError naming ``name`` unless ``value`` is a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")


def parse_tenant_weights(value: dict | str | None) -> dict[str, float]:
    """``tenant_weights`` as a dict: a dict checked as it is, ``"a=2,b=0.5"`` (the
    ``--tenant-weights`` form) parsed, None or a blank string empty.

    Raises:
        ValueError: an entry that is not ``NAME=NUMBER``, an empty or repeated name, or a weight
            that is not a finite number > 0, naming ``tenant_weights`` and the entry.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}
    if isinstance(value, str):
        out: dict[str, float] = {}
        for item in value.split(","):
            name, sep, num = item.strip().partition("=")
            name = name.strip()
            try:
                weight = float(num) if sep and name else None
            except ValueError:
                weight = None
            if weight is None:
                raise ValueError(
                    f"tenant_weights entry {item.strip()!r} is not NAME=WEIGHT (e.g. 'a=2,b=1')."
                )
            if name in out:
                raise ValueError(f"tenant_weights names {name!r} twice.")
            out[name] = weight
        value = out
    if not isinstance(value, dict):
        raise ValueError(f"tenant_weights must be a dict or 'NAME=WEIGHT,...', got {type(value).__name__}.")
    for name, weight in value.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tenant_weights names must be non-empty strings, got {name!r}.")
        _positive_float(f"tenant_weights[{name!r}]", weight)
    return {name: float(w) for name, w in value.items()}


@dataclass
class ModelConfig:
    """Which model to run and how.

    Attributes:
        model: ``None`` / ``"default"`` for the embedded SmolLM2-135M-Instruct, or a local HF
            directory (config.json + *.safetensors + tokenizer files).
        dtype: ``"auto"`` (float32 on CPU, bfloat16 on CUDA), ``"float32"``, ``"bfloat16"``,
            ``"float16"``.
        device: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``.
        seed: global RNG seed.
        max_model_len: context length in tokens (prompt + output); ``None`` = the model's
            ``max_position_embeddings``.
        quantization: ``None`` or ``"none"`` (float weights: a GGUF dequantized, or a
            checkpoint's own ``quantization_config``; ``"none"`` is stored as ``None``; the
            engine's automatic choice for a ``.gguf`` file is made before, by
            ``EngineArgs.resolve_quantization``);
            ``"gguf"``: ``model`` is a GGUF file (or the default model's) whose Q8_0 / Q4_0 /
            Q4_1 / Q4_K / Q5_K / Q6_K weights run quantized; ``"int8"`` / ``"int4"``: any float
            checkpoint, its linear weights quantized at load to int8 (Q8_0 blocks: a scale per
            32 weights) / int4 (Q4_1 blocks: a scale and offset per 32 weights), weight-only;
            ``"gptq"`` / ``"awq"`` / ``"compressed-tensors"``: a checkpoint quantized so (the
            same as unset, but checked). All CPU only.
        model_impl: ``auto``, ``native`` or ``transformers`` (``MODEL_IMPL_CHOICES``): which
            implementation runs the checkpoint's architecture.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    quantization: str | None = None
    model_impl: str = "auto"

    #: Sleep mode (``LLMEngine.sleep`` / ``wake_up``, the server's ``/sleep`` and ``/wake_up``):
    #: free the KV cache and offload (level 1) or drop (level 2) the weights while idle.
    enable_sleep_mode: bool = False

    def __post_init__(self) -> None:
        check_model_impl(self.model_impl)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of auto|float32|bfloat16|float16, got {self.dtype!r}.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be one of auto|cpu|cuda, got {self.device!r}.")
        _positive_int("max_model_len", self.max_model_len, allow_none=True)
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization must be one of {'|'.join(QUANTIZATION_CHOICES)} or unset, got {self.quantization!r}."
            )
        if self.quantization == "none":
            self.quantization = None  # float weights: what every loader reads from None

    def resolved_device(self) -> str:
        """``cpu`` or ``cuda``. Raises ValueError if ``cuda`` is asked for and absent."""
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but torch.cuda.is_available() is False.")
        return self.device

    def resolved_dtype(self):
        """A ``torch.dtype``."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device() == "cuda" else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]


@dataclass
class CacheConfig:
    """Paged KV-cache sizes.

    Attributes:
        block_size: tokens per KV block.
        num_gpu_blocks: device-pool blocks (the seed's name, used on CPU too); ``None`` =
            derived from ``kv_cache_memory_gib``.
        kv_cache_memory_gib: memory for the device pool when ``num_gpu_blocks`` is unset.
        num_cpu_blocks: swap-pool blocks; ``None`` = derived from ``swap_space_gib``.
        swap_space_gib: memory for the CPU swap pool when ``num_cpu_blocks`` is unset.
        sliding_window: tokens of attention window (set from the model config), or ``None``.
        enable_prefix_caching: reuse KV blocks across requests by hashed token content.
        watermark: fraction of device blocks kept free when admitting prefills (avoids
            immediate preemption of what was just admitted).
        waiting_aware_eviction: with prefix caching, evict cached blocks that a waiting
            request's prompt holds only after every other cached block (False: plain
            least-recently-released order).
        gpu_memory_utilization: when set (0 < u <= 1) and ``num_gpu_blocks`` is unset, the
            device pool is sized to fill this fraction of the memory the weights and KV share
            (device memory on CUDA, physical host memory on CPU), less what the process
            already holds; it then replaces ``kv_cache_memory_gib``.
        kv_offload_gib: host memory (GiB) for the prefix cache's host tier: cached blocks the
            device pool evicts are copied there and swapped back in on a later hit (0: off).
            Needs ``enable_prefix_caching``. The host pool is the swap pool plus this.
        num_kv_offload_blocks: host-tier blocks; ``None`` = derived from ``kv_offload_gib``.
        kv_offload_dir: a directory for the disk tier: host-tier blocks are also written there
            (in the background) and read back into the host tier at start, so a restarted
            engine starts warm. Needs the host tier. None: no disk tier.
        kv_offload_disk_gib: bound of the disk tier's files (least recently used go first).
        cache_dtype: how K/V are stored (``KV_CACHE_DTYPES``; ``fp8`` is kept as ``fp8_e4m3``):
            ``auto`` = the model dtype, else one byte per value and a scale per token and head,
            so a block takes about half the bytes of bfloat16 and more blocks fit.
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    num_cpu_blocks: int | None = None
    swap_space_gib: float = 0.5
    sliding_window: int | None = None
    enable_prefix_caching: bool = False
    watermark: float = 0.01
    gpu_memory_utilization: float | None = None
    waiting_aware_eviction: bool = True
    kv_offload_gib: float = 0.0
    num_kv_offload_blocks: int | None = None
    kv_offload_dir: str | None = None
    kv_offload_disk_gib: float = 4.0
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        self.cache_dtype = check_kv_cache_dtype(self.cache_dtype)
        _positive_int("block_size", self.block_size)
        _check_utilization(self.gpu_memory_utilization)
        _positive_int("num_gpu_blocks", self.num_gpu_blocks, allow_none=True)
        if self.num_cpu_blocks is not None and (
            not isinstance(self.num_cpu_blocks, int) or self.num_cpu_blocks < 0
        ):
            raise ValueError(f"num_cpu_blocks must be an integer >= 0, got {self.num_cpu_blocks!r}.")
        if not isinstance(self.kv_cache_memory_gib, (int, float)) or self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib!r}.")
        if not isinstance(self.swap_space_gib, (int, float)) or self.swap_space_gib < 0:
            raise ValueError(f"swap_space_gib must be >= 0, got {self.swap_space_gib!r}.")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}.")
        _positive_int("sliding_window", self.sliding_window, allow_none=True)
        if not isinstance(self.kv_offload_gib, (int, float)) or not 0 <= self.kv_offload_gib < float("inf"):
            raise ValueError(f"kv_offload_gib must be a finite number >= 0, got {self.kv_offload_gib!r}.")
        if self.num_kv_offload_blocks is not None and (
            not isinstance(self.num_kv_offload_blocks, int) or self.num_kv_offload_blocks < 0
        ):
            raise ValueError(
                f"num_kv_offload_blocks must be an integer >= 0, got {self.num_kv_offload_blocks!r}."
            )
        if (self.kv_offload_gib or self.num_kv_offload_blocks) and not self.enable_prefix_caching:
            raise ValueError(
                "kv_offload_gib / num_kv_offload_blocks (the prefix cache's host tier) need "
                "enable_prefix_caching=True."
            )
        if self.kv_offload_dir is not None and not (self.kv_offload_gib or self.num_kv_offload_blocks):
            raise ValueError("kv_offload_dir (the disk tier) needs the host tier: set kv_offload_gib > 0.")
        if not isinstance(self.kv_offload_disk_gib, (int, float)) or not 0 < self.kv_offload_disk_gib < float(
            "inf"
        ):
            raise ValueError(
                f"kv_offload_disk_gib must be a finite number > 0, got {self.kv_offload_disk_gib!r}."
            )

    def resolve_kv_offload_blocks(self, bytes_per_block: int) -> int:
        """Set and return ``num_kv_offload_blocks`` (from ``kv_offload_gib`` over
        ``bytes_per_block`` bytes when unset)."""
        if self.num_kv_offload_blocks is None:
            self.num_kv_offload_blocks = int(self.kv_offload_gib * 2**30 // bytes_per_block)
        return self.num_kv_offload_blocks

    def num_host_blocks(self) -> int:
        """Blocks of the host pool: the swap pool (``num_cpu_blocks``) plus the host tier."""
        return (self.num_cpu_blocks or 0) + (self.num_kv_offload_blocks or 0)


#: Largest LoRA rank ``LoRAConfig.max_lora_rank`` accepts.
MAX_LORA_RANK_LIMIT = 512
#: Upper bound of ``LoRAConfig.max_slot_preemptions`` (each one re-prefills the group).
MAX_SLOT_PREEMPTIONS_LIMIT = 8


@dataclass
class LoRAConfig:
    """Multi-LoRA serving limits (vLLM's ``LoRAConfig`` names).

    Attributes:
        max_loras: distinct adapters one step may hold (device slots; >= 1). The scheduler
            defers, in order, groups whose adapter would exceed it.
        max_lora_rank: the largest adapter rank accepted (1..``MAX_LORA_RANK_LIMIT``); a
            larger adapter is refused when it is added.
        max_cpu_loras: adapters kept loaded in the CPU LRU cache (>= ``max_loras``; ``None`` =
            ``max_loras``).
        max_slot_preemptions: slot turnover (ours; 0 = off, vLLM V0's rule): how many times one
            group may be preempted (by recompute) to free its adapter's slot for the first
            adapter that waits for one, when all slots are held and that adapter has at least
            twice as many groups waiting as the freed adapter has running (>= 0).

    Raises:
        ValueError: a bad value, naming the field and the limit.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    max_slot_preemptions: int = 0

    def __post_init__(self) -> None:
        _positive_int("max_loras", self.max_loras)
        m = self.max_slot_preemptions
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= MAX_SLOT_PREEMPTIONS_LIMIT:
            raise ValueError(
                f"max_slot_preemptions must be an integer in [0, {MAX_SLOT_PREEMPTIONS_LIMIT}], got {m!r}."
            )
        r = self.max_lora_rank
        if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= MAX_LORA_RANK_LIMIT:
            raise ValueError(f"max_lora_rank must be an integer in [1, {MAX_LORA_RANK_LIMIT}], got {r!r}.")
        _positive_int("max_cpu_loras", self.max_cpu_loras, allow_none=True)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")


#: Policies that backfill past a blocked head unless told otherwise. ``fcfs`` and ``priority``
#: keep vLLM V0's admission (stop at the first group that must wait), which their callers and
#: tests rely on; a policy that promises fairness between requests does not.
BACKFILL_POLICIES = frozenset({"fair"})


def default_scheduling_backfill(policy: str) -> bool:
    """Whether policy ``policy`` backfills when ``scheduling_backfill`` is None."""
    return policy in BACKFILL_POLICIES


@dataclass
class SchedulerConfig:
    """Batching limits and scheduling behaviour.

    Attributes:
        max_num_batched_tokens: tokens per step (prefill + decode); ``None`` = ``max_model_len``
            without chunked prefill (so any admissible prompt fits one step), 512 with it.
        max_num_seqs: sequences per step.
        max_model_len: context length in tokens (filled from the model config).
        chunked_prefill_enabled: split long prompts across steps and mix them with decodes.
        preemption_mode: ``None`` = RECOMPUTE for single-sequence groups, SWAP for groups
            with several live sequences; AUTO = the cheaper of the two per victim (priced by
            the scheduler's ``preemption_cost``); or force one mode for all groups.
        policy: queue ordering policy name (``fcfs``, ``priority``, ``fair``).
        fair_input_weight: ``fair`` policy: cost of one prefill token in a tenant's counter (> 0).
        fair_output_weight: ``fair`` policy: cost of one decode token (> 0); 2.0 by default, the
            1:2 input:output ratio of the VTC paper (Sheng et al., OSDI 2024).
        tenant_weights: ``fair`` policy: tenant -> share weight (> 0; 1.0 for tenants not
            listed); counters grow by cost / weight.
        fair_burst_tokens: ``fair`` policy: weighted tokens per unit of weight (>= 0) a tenant joining a busy
            engine may be served ahead of the least-served backlogged tenant (``FairPolicy``);
            0 = the VTC paper's lift exactly.
        scheduling_backfill: admit waiting groups that fit past a head that must wait for KV
            blocks (or, without chunked prefill, for the step's token budget), without delaying
            its admission (see ``kvserve.core.scheduler``); ``None`` = the policy's default
            (``default_scheduling_backfill``).
        max_num_partial_prefills: with chunked prefill, how many prompts may be mid-prefill at once.
        long_prefill_token_threshold: with chunked prefill, the most tokens one prompt may take
            in a step (``None`` = 4% of max_model_len, at least one block... see scheduler).
        max_decode_slowdown: with chunked prefill, the most (a factor > 1) that prompt tokens
            may slow the decodes running beside them, on average over steps: steps carry only
            as many as a bucket of measured step time allows (``kvserve.core.prefill_cap``);
            ``None`` = no cap but the token budget.
        max_waiting: bound on the waiting queue (the server answers 503 past it); ``None`` = no bound.
        num_lookahead_slots: KV slots reserved per decoding sequence beyond its next token, for
            speculative decoding (``SpeculativeConfig.num_speculative_tokens``; 0 = off).
            Prefills reserve none.
        spec_decode_disable_by_batch_size: with lookahead slots, a step with more running
            sequences than this reserves none (plain decode for all); ``None`` = never.
        delay_factor: vLLM V0's prompt delay (>= 0, unitless): while groups are running, new
            prompts are admitted only once the oldest waiting one has waited longer than
            ``delay_factor`` times the latency of the last step that admitted prompts, so
            that more of them are batched together; 0.0 (default) admits at once.
    """

    # None = derived in __post_init__ (an int from then on, which is what the scheduler reads)
    max_num_batched_tokens: int = None  # type: ignore[assignment]
    max_num_seqs: int = 256
    max_model_len: int = 2048
    chunked_prefill_enabled: bool = False
    preemption_mode: PreemptionMode | None = None
    policy: str = "fcfs"
    scheduling_backfill: bool | None = None
    max_num_partial_prefills: int = 1
    long_prefill_token_threshold: int | None = None
    max_decode_slowdown: float | None = None
    max_waiting: int | None = None
    num_lookahead_slots: int = 0
    delay_factor: float = 0.0
    spec_decode_disable_by_batch_size: int | None = None
    fair_input_weight: float = 1.0
    fair_output_weight: float = 2.0
    tenant_weights: dict[str, float] = field(default_factory=dict)
    fair_burst_tokens: float = 2048.0

    @staticmethod
    def parse_preemption_mode(value: PreemptionMode | str | None) -> PreemptionMode | None:
        """``value`` as a ``PreemptionMode``: a mode as it is, ``"recompute"`` / ``"swap"`` /
        ``"auto"`` (any case) by name, None as None. Raises ValueError for any other string."""
        if not isinstance(value, str):
            return value
        try:
            return PreemptionMode[value.upper()]
        except KeyError:
            raise ValueError(
                f"preemption_mode must be 'recompute', 'swap' or 'auto' (or unset), got {value!r}."
            ) from None

    @staticmethod
    def default_max_num_batched_tokens(chunked_prefill_enabled: bool, max_model_len: int) -> int:
        """The step token budget when none is given: ``CHUNKED_PREFILL_TOKENS`` with chunked
        prefill, else room for a whole prompt (``max_model_len``, at least 512)."""
        return CHUNKED_PREFILL_TOKENS if chunked_prefill_enabled else max(max_model_len, 512)

    def __post_init__(self) -> None:
        self.preemption_mode = self.parse_preemption_mode(self.preemption_mode)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_model_len", self.max_model_len)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = self.default_max_num_batched_tokens(
                self.chunked_prefill_enabled, self.max_model_len
            )
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_num_partial_prefills", self.max_num_partial_prefills)
        _positive_int("long_prefill_token_threshold", self.long_prefill_token_threshold, allow_none=True)
        if self.max_decode_slowdown is not None:
            v = self.max_decode_slowdown
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 1 < v < float("inf"):
                raise ValueError(f"max_decode_slowdown must be a finite number > 1, got {v!r}.")
            if not self.chunked_prefill_enabled:
                raise ValueError(
                    "max_decode_slowdown needs chunked prefill (--enable-chunked-prefill): without "
                    "it a prompt runs whole, in a step of its own."
                )
        _positive_int("max_waiting", self.max_waiting, allow_none=True)
        if self.num_lookahead_slots < 0:
            raise ValueError(f"num_lookahead_slots must be >= 0, got {self.num_lookahead_slots!r}.")
        if not isinstance(self.delay_factor, (int, float)) or not 0 <= self.delay_factor < float("inf"):
            raise ValueError(f"delay_factor must be a finite number >= 0, got {self.delay_factor!r}.")
        _positive_int("spec_decode_disable_by_batch_size", self.spec_decode_disable_by_batch_size, True)
        _positive_float("fair_input_weight", self.fair_input_weight)
        _positive_float("fair_output_weight", self.fair_output_weight)
        self.tenant_weights = parse_tenant_weights(self.tenant_weights)
        check_non_negative("fair_burst_tokens", self.fair_burst_tokens)
        if self.scheduling_backfill is not None and not isinstance(self.scheduling_backfill, bool):
            raise ValueError(
                f"scheduling_backfill must be True, False or None (the policy's default), "
                f"got {self.scheduling_backfill!r}."
            )

    @property
    def backfill_enabled(self) -> bool:
        """``scheduling_backfill``, or the policy's default when it is None."""
        if self.scheduling_backfill is None:
            return default_scheduling_backfill(self.policy)
        return self.scheduling_backfill


#: Speculation methods ``SpeculativeConfig.method`` accepts.
SPECULATIVE_METHODS = ("ngram", "draft_model")


def json_object(value: object, name: str = "speculative_config") -> dict | None:
    """``value`` as a dict: a dict as it is, a JSON object string decoded, None or a blank
    string None (``--speculative-config`` and its like).

    Raises:
        ValueError: not JSON, or not an object (any other type included), naming ``name``.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:  # RecursionError: nested past the parser's depth
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}.")
    return value


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` names).

    Each decoding sequence gets up to ``num_speculative_tokens`` proposed tokens per step; the
    target model scores all of them plus one more position in one forward and keeps the longest
    accepted prefix plus one token of its own (Leviathan et al. 2023; Chen et al. 2023).

    Attributes:
        method: ``"ngram"`` (prompt lookup over prompt + output so far, Saxena 2023) or
            ``"draft_model"`` (a small local HF Llama-family model sharing the tokenizer).
        num_speculative_tokens: proposed tokens per sequence per step (k, 1..64).
        prompt_lookup_min / prompt_lookup_max: n-gram sizes tried, longest first (ngram only;
            1 <= min <= max <= 64).
        model: the draft model's local HF directory (required for, and only for, draft_model).
        disable_by_batch_size: a step with more running sequences than this does not speculate
            (no lookahead slots, plain decode); ``None`` = always speculate.
        disable_below_acceptance_rate: a request whose own acceptance rate (accepted / drafted
            tokens) is below this over a window of ``acceptance_window`` drafted tokens (each
            window counted afresh) pauses speculating
            for ``acceptance_window * 2**pauses`` output tokens, then speculates again and is
            judged on its new drafts (0.0 = never), in [0, 1].
        acceptance_window: drafted tokens before that rule is applied (>= 1).
        dynamic: True (default): each step the worker chooses how many of its
            ``num_speculative_tokens`` slots each sequence fills (0 included) to maximise
            expected tokens per second, from an online step-cost model and per-sequence
            acceptance estimates (``kvserve/spec_decode/goodput.py``); with ``ngram`` a
            sequence with no match at ``prompt_lookup_min`` may also get a 1-gram match's
            drafts where that pays. False: every sequence gets up to ``num_speculative_tokens``
            drafts every step (the fixed-k behaviour).

    Raises:
        ValueError: a bad value, naming the field (``speculative_config.<field>``) and the limit.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    disable_by_batch_size: int | None = None
    disable_below_acceptance_rate: float = 0.1
    acceptance_window: int = 32
    dynamic: bool = True

    def __post_init__(self) -> None:
        f = "speculative_config."
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"{f}dynamic must be true or false, got {self.dynamic!r}.")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"{f}method must be one of {'|'.join(SPECULATIVE_METHODS)}, got {self.method!r}."
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 64:
                raise ValueError(f"{f}{name} must be an integer in [1, 64], got {v!r}.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"{f}prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})."
            )
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"{f}model is required for method 'draft_model' (a local HF directory).")
        elif self.model is not None:
            raise ValueError(f"{f}model is only used by method 'draft_model', got method {self.method!r}.")
        _positive_int(f"{f}disable_by_batch_size", self.disable_by_batch_size, allow_none=True)
        r = self.disable_below_acceptance_rate
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0.0 <= r <= 1.0:
            raise ValueError(f"{f}disable_below_acceptance_rate must be a number in [0, 1], got {r!r}.")
        _positive_int(f"{f}acceptance_window", self.acceptance_window)

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """Parse ``value``: a ``SpeculativeConfig``, a dict of its fields, a JSON object string
        (the CLI's ``--speculative-config``), or None / ``""`` (off).

        Raises:
            ValueError: not a JSON object, an unknown key, or a bad value (naming the field).
        """
        if isinstance(value, cls):
            return value
        value = json_object(value)
        if value is None:
            return None
        known = {fl.name for fl in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config.{unknown[0]} is not a known field (known: {', '.join(sorted(known))})."
            )
        method = value.get("method", cls.method)
        lookup = sorted(k for k in ("prompt_lookup_min", "prompt_lookup_max") if k in value)
        if lookup and method != "ngram" and method in SPECULATIVE_METHODS:
            # as model with ngram: a field the method would ignore is refused, not dropped
            raise ValueError(
                f"speculative_config.{lookup[0]} is only used by method 'ngram', got method {method!r}."
            )
        return cls(**value)


#: Largest ``tensor_parallel_size`` accepted (a sanity bound: every rank is a process).
MAX_TENSOR_PARALLEL_SIZE = 64


@dataclass
class ParallelConfig:
    """How one engine is spread over processes (vLLM's name and field).

    Attributes:
        tensor_parallel_size: ranks that each hold a 1/T shard of every layer (attention
            heads and KV heads, MLP columns) and of the KV cache (by KV head); the driver (rank
            0) schedules and samples, the others run their shard of each forward.

    Raises:
        ValueError: a size below 1 or above ``MAX_TENSOR_PARALLEL_SIZE``, naming the field.
    """

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        t = self.tensor_parallel_size
        if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= MAX_TENSOR_PARALLEL_SIZE:
            raise ValueError(
                f"tensor_parallel_size must be an integer in [1, {MAX_TENSOR_PARALLEL_SIZE}], got {t!r}."
            )

    def verify_with_model(self, hf_config, device: str, quantization: str | None = None) -> None:
        """Check that the model's shapes and the devices allow this split.

        Args:
            quantization: the engine's ``quantization`` (``int8`` / ``int4`` quantize each
                rank's shard in blocks of 32 input columns).

        Raises:
            ValueError: ``tensor_parallel_size`` does not divide ``num_attention_heads``,
                ``num_key_value_heads`` or ``intermediate_size`` (the message names the counts
                and T); with ``int8`` / ``int4``, a row-parallel shard (o_proj, down_proj) whose
                input columns are not whole 32-weight blocks; or (CUDA) T is larger than the
                number of visible devices.
        """
        t = self.tensor_parallel_size
        if t == 1:
            return
        heads = int(hf_config.num_attention_heads)
        kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        if heads % t or kv % t:
            raise ValueError(
                f"tensor_parallel_size={t} must divide both num_attention_heads={heads} and "
                f"num_key_value_heads={kv} (each rank holds heads/T query and KV heads)."
            )
        inter = int(hf_config.intermediate_size)
        # mixture-of-experts checkpoints: each rank holds 1/T of every expert's (and the shared
        # expert's) intermediate columns too
        inters = [("intermediate_size", inter)] + [
            (name, int(getattr(hf_config, name)))
            for name in ("moe_intermediate_size", "shared_expert_intermediate_size")
            if getattr(hf_config, name, None)
        ]
        for name, size in inters:
            if size % t:
                raise ValueError(f"tensor_parallel_size={t} must divide {name}={size}.")
        if quantization in ("int8", "int4"):
            # o_proj and down_proj are split by input columns: each rank's slice is quantized
            # on its own, so it must be whole blocks (the column-parallel ones keep all columns)
            head_dim = int(getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // heads)
            q_cols = heads * head_dim
            bad = [
                f"{what} {full}/{t} = {full // t}"
                for what, full in [("o_proj", q_cols)] + [(f"down_proj {f}", n) for f, n in inters]
                if (full // t) % 32
            ]
            if bad:
                block = "Q8_0" if quantization == "int8" else "Q4_1"
                raise ValueError(
                    f"quantization={quantization!r} with tensor_parallel_size={t} needs each rank's "
                    f"input columns to be whole {block} blocks of 32: {', '.join(bad)}; use a "
                    "tensor_parallel_size that keeps them so, or no quantization."
                )
        if device == "cuda":
            import torch

            n = torch.cuda.device_count()
            if t > n:
                raise ValueError(
                    f"tensor_parallel_size={t} needs {t} CUDA devices (one per rank), but only {n} "
                    "are visible."
                )


#: ``EngineArgs.runner`` and ``EngineArgs.convert`` values (vLLM's).
RUNNER_CHOICES = ("auto", "generate", "pooling")
CONVERT_CHOICES = ("auto", "none", "embed")


@dataclass
class EngineArgs:
    """All engine settings by their public names (``LLM(**kwargs)``, CLI ``--kebab-case``).

    ``create_configs(model_max_len, sliding_window)`` splits them into the three configs once
    the model's own limits are known.

    ``enable_chunked_prefill=None`` (the default) means on when the engine runs on CPU, off on
    CUDA (vLLM V0's default). Chunked prefill on CPU without ``max_num_batched_tokens`` gets a
    ``CPU_CHUNKED_PREFILL_TOKENS`` step budget (``FAIR_CPU_CHUNKED_PREFILL_TOKENS`` under the
    ``fair`` policy).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    num_cpu_blocks: int | None = None
    swap_space_gib: float = 0.5
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool = False
    #: ``CacheConfig.waiting_aware_eviction``: cached blocks a waiting prompt needs go last.
    waiting_aware_eviction: bool = True
    #: ``CacheConfig.kv_offload_gib``: host memory for the prefix cache's host tier (0: off).
    kv_offload_gib: float = 0.0
    #: ``CacheConfig.num_kv_offload_blocks`` (None: from ``kv_offload_gib``).
    num_kv_offload_blocks: int | None = None
    #: ``CacheConfig.kv_offload_dir``: the disk tier's directory (None: no disk tier).
    kv_offload_dir: str | None = None
    #: ``CacheConfig.kv_offload_disk_gib``: bound of the disk tier's files.
    kv_offload_disk_gib: float = 4.0
    #: ``CacheConfig.cache_dtype``: ``auto`` (the model dtype), ``int8``, ``fp8`` /
    #: ``fp8_e4m3``, ``fp8_e5m2`` (``KV_CACHE_DTYPES``).
    kv_cache_dtype: str = "auto"
    preemption_mode: str | None = None
    #: ``SchedulerConfig.policy`` (CLI ``--scheduling-policy``, alias ``--policy``).
    policy: str = "fcfs"
    fair_input_weight: float = 1.0
    fair_output_weight: float = 2.0
    #: ``SchedulerConfig.tenant_weights``: a dict, or ``"a=2,b=1"`` (the CLI form).
    tenant_weights: dict[str, float] | str | None = None
    fair_burst_tokens: float = 2048.0
    #: ``SchedulerConfig.scheduling_backfill`` (None = the policy's default).
    scheduling_backfill: bool | None = None
    max_num_partial_prefills: int = 1
    long_prefill_token_threshold: int | None = None
    #: ``SchedulerConfig.max_decode_slowdown`` (None: no cap but the token budget).
    max_decode_slowdown: float | None = None
    max_waiting: int | None = None
    watermark: float = 0.01
    delay_factor: float = 0.0
    quantization: str | None = None
    #: ``SpeculativeConfig`` fields as a dict or a JSON object string; None = off.
    speculative_config: dict | str | None = None
    #: Multi-LoRA serving (``create_lora_config``); the limits are ``LoRAConfig``'s.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    #: ``LoRAConfig.max_slot_preemptions`` (0 = off).
    max_slot_preemptions: int = 0
    #: Data parallelism (``kvserve.distributed``): this many engine replicas on Ray, each with
    #: its own KV cache; 1 = this process only (Ray is never imported).
    data_parallel_size: int = 1
    #: Ray cluster to join (``auto``, ``HOST:PORT``); None = start a local Ray runtime.
    ray_address: str | None = None
    #: How a request picks its replica: ``prefix`` (longest cached prefix within the balance
    #: threshold), ``least-loaded`` or ``round-robin``.
    router: str = "prefix"
    #: ``prefix`` router: the best-matching replica is skipped for the least-loaded one when it
    #: has more than this many outstanding requests over it.
    router_balance_threshold: int = 8
    #: Ranks per engine (``ParallelConfig``); 1 = one process.
    tensor_parallel_size: int = 1
    #: ``CacheConfig.gpu_memory_utilization``: the device pool fills this fraction of device
    #: memory (CUDA) or physical host memory (CPU), less what the process holds; None = sized
    #: by ``kv_cache_memory_gib``.
    gpu_memory_utilization: float | None = None
    #: Default sampling parameters: ``auto`` = the model directory's generation_config.json,
    #: ``vllm`` = none (kvserve's defaults), or a directory holding a generation_config.json.
    generation_config: str = "auto"
    #: generation_config.json keys (or SamplingParams names) set over the file's, as a dict or
    #: a JSON object string.
    override_generation_config: dict | str | None = None

    #: Which implementation runs the architecture (``MODEL_IMPL_CHOICES``): ``auto`` = its native
    #: family, else the transformers fallback; ``native``; ``transformers`` (the fallback).
    model_impl: str = "auto"

    #: Sleep mode (``LLMEngine.sleep`` / ``wake_up``, the server's ``/sleep`` and ``/wake_up``):
    #: free the KV cache and offload (level 1) or drop (level 2) the weights while idle.
    enable_sleep_mode: bool = False

    #: ``generate`` (text generation), ``pooling`` (embeddings and scores: ``LLM.embed``,
    #: ``/v1/embeddings``), or ``auto``: pooling for an encoder-only architecture (BERT),
    #: generation otherwise. vLLM's ``--runner``.
    runner: str = "auto"
    #: ``embed``: run a decoder checkpoint as an embedding model (its final hidden states
    #: pooled, ``pooler_config``); ``none`` / ``auto``: as it is. vLLM's ``--convert``.
    convert: str = "auto"
    #: The pooler's settings over the checkpoint's (``pooling_type``: ``MEAN`` | ``CLS`` |
    #: ``LAST``, ``normalize``), a dict or a JSON object string. vLLM's ``--pooler-config``.
    pooler_config: dict | str | None = None

    def __post_init__(self) -> None:
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        self.model_impl = MODEL_IMPL_ALIASES.get(self.model_impl, self.model_impl)
        check_model_impl(self.model_impl)
        if self.model_impl == "transformers":
            # settings the fallback cannot run, refused before anything loads (with ``auto`` the
            # architecture decides, known once its config is read: ``model_loader``)
            for setting in self._fallback_conflicts():
                raise fallback_conflict_error(setting, "model_impl='transformers'")
        _check_utilization(self.gpu_memory_utilization)
        check_kv_cache_dtype(self.kv_cache_dtype)
        # 0 would otherwise read as unset (the model's length) in create_configs
        _positive_int("max_model_len", self.max_model_len, allow_none=True)
        _positive_float("fair_input_weight", self.fair_input_weight)
        _positive_float("fair_output_weight", self.fair_output_weight)
        check_non_negative("fair_burst_tokens", self.fair_burst_tokens)
        parse_tenant_weights(self.tenant_weights)  # a bad weight fails here, naming the flag
        self.generation_overrides()
        if self.runner not in RUNNER_CHOICES:
            raise ValueError(f"runner must be one of {'|'.join(RUNNER_CHOICES)}, got {self.runner!r}.")
        if self.convert not in CONVERT_CHOICES:
            raise ValueError(f"convert must be one of {'|'.join(CONVERT_CHOICES)}, got {self.convert!r}.")
        if self.convert == "embed" and self.runner == "generate":
            raise ValueError("convert='embed' makes a pooling model; it needs runner='pooling' or 'auto'.")
        if (self.runner == "pooling" or self.convert == "embed") and self.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 is not supported with runner='pooling' (use 1).")
        self.pooler_overrides()
        # A bad speculative_config or LoRA limit is refused here, before any model is loaded.
        self.create_speculative_config()
        self.create_lora_config()
        _positive_int("data_parallel_size", self.data_parallel_size)
        if self.data_parallel_size > 1 and self.enable_lora:
            # replicas take no lora_request and have no adapter routes yet
            raise ValueError("enable_lora is not supported with data_parallel_size > 1.")
        if self.router not in ("prefix", "least-loaded", "round-robin"):
            raise ValueError(f"router must be one of prefix|least-loaded|round-robin, got {self.router!r}.")
        rbt = self.router_balance_threshold
        if not isinstance(rbt, int) or isinstance(rbt, bool) or rbt < 0:
            raise ValueError(f"router_balance_threshold must be an integer >= 0, got {rbt!r}.")
        self.create_parallel_config()
        if self.enable_sleep_mode:
            if self.data_parallel_size > 1:
                raise ValueError(
                    "enable_sleep_mode is not supported with data_parallel_size > 1 (the replicas have no "
                    "sleep route); use data_parallel_size=1."
                )
            if self.speculative_config is not None:
                raise ValueError(
                    "enable_sleep_mode is not supported with speculative_config (the draft model's weights "
                    "and cache would stay); leave one of them unset."
                )
        if self.quantization == "gguf":
            # explicit: a setting the quantized path cannot run is refused before anything loads
            # (device='auto' resolving to CUDA is found by resolve_quantization)
            conflicts = self._gguf_conflicts(resolve_device=False)
            if conflicts:
                raise _gguf_conflict_error(*conflicts[0])

    def _fallback_conflicts(self) -> list[str]:
        """The settings (as typed) that the transformers fallback cannot run."""
        out = []
        if self.quantization not in (None, "none"):
            out.append(f"quantization={self.quantization!r}")
        if self.tensor_parallel_size != 1:
            out.append(f"tensor_parallel_size={self.tensor_parallel_size}")
        if self.enable_lora:
            out.append("enable_lora=True")
        return out

    def _gguf_conflicts(self, resolve_device: bool = True) -> list[tuple[str, str]]:
        """The settings that ``quantization='gguf'`` cannot run, as ``(setting, why)`` pairs.
        ``resolve_device``: also resolve ``device='auto'`` (imports torch)."""
        out = []
        if self.device == "cuda":
            out.append(("device='cuda'", "its kernels run on CPU only"))
        elif self.device == "auto" and resolve_device:
            if ModelConfig(device="auto").resolved_device() == "cuda":
                out.append(("device='auto' (CUDA is available)", "its kernels run on CPU only"))
        if self.dtype == "float16":
            out.append(("dtype='float16'", "its kernels compute in float32 or bfloat16"))
        if self.tensor_parallel_size != 1:
            out.append(
                (f"tensor_parallel_size={self.tensor_parallel_size}", "quantized blocks are not sharded")
            )
        if self.enable_lora:
            out.append(("enable_lora", "LoRA adapters apply to float weights only"))
        if self.model_impl == "transformers":
            out.append(("model_impl='transformers'", "the transformers fallback runs float weights only"))
        return out

    def resolve_quantization(self, quantized_kernels: bool = True) -> QuantizationChoice:
        """What runs: a GGUF's own blocks or its float conversion, or ``quantization`` as given.

        With ``quantization`` unset and ``model`` an explicit ``.gguf`` path, the file's
        quantized blocks run (``"gguf"``, as in llama.cpp, Ollama and vLLM) unless a setting needs
        float weights (``_gguf_conflicts``: CUDA, float16, tensor parallelism, LoRA) or the
        quantized kernels are not built (their torch fallback dequantizes every weight on every
        call); then the file is dequantized to float and ``gguf_float_reason`` says why. The
        default model (``model`` unset) stays on its float conversion, which the golden tests
        compare token for token with transformers. ``"none"`` is float weights.

        Args:
            quantized_kernels: whether the quantized kernels are built (the engine passes
                ``kvserve.ops.quant.available()``; this module imports no kernels).

        Raises:
            ValueError: ``quantization='gguf'`` with ``device='auto'`` resolving to CUDA (its
                other conflicts are refused at construction), naming the setting.
        """
        q = self.quantization
        default = self.model is None or self.model == "default"
        gguf = default or is_gguf_path(self.model)
        if q == "gguf":
            conflicts = self._gguf_conflicts()
            if conflicts:
                raise _gguf_conflict_error(*conflicts[0])
            return QuantizationChoice("gguf", None)
        if q == "none":
            return QuantizationChoice(None, "quantization='none'" if gguf else None)
        if q is not None or not gguf:
            return QuantizationChoice(q, None)
        if default:
            return QuantizationChoice(
                None,
                "the default model runs its float conversion, compared token for token with "
                "transformers; quantization='gguf' runs its quantized blocks",
            )
        conflicts = self._gguf_conflicts()
        if conflicts:
            return QuantizationChoice(None, "; ".join(f"{setting}: {why}" for setting, why in conflicts))
        if not quantized_kernels:
            return QuantizationChoice(
                None,
                "the quantized kernels are not built (KVSERVE_NATIVE=0 or no C compiler): their "
                "fallback would dequantize every weight on every call",
            )
        return QuantizationChoice("gguf", None)

    def pooler_overrides(self) -> dict[str, Any]:
        """``pooler_config`` as a dict ({} when unset); its keys are checked when the model's
        pooler is built (``layers.pooler.read_pooler_config``).

        Raises:
            ValueError: not a JSON object (naming the field).
        """
        return _json_object("pooler_config", self.pooler_config)

    def generation_overrides(self) -> dict[str, Any]:
        """``override_generation_config`` as a dict ({} when unset).

        Raises:
            ValueError: not a JSON object (naming the field).
        """
        return _json_object("override_generation_config", self.override_generation_config)

    def replica_args(self) -> EngineArgs:
        """The settings of one data-parallel replica: these, with ``data_parallel_size=1`` (the
        other fields, tensor parallelism's included, pass through as they are)."""
        import dataclasses

        return dataclasses.replace(self, data_parallel_size=1)

    def create_parallel_config(self) -> ParallelConfig:
        """The ``ParallelConfig``. Raises ValueError naming the field, also for settings
        the tensor-parallel path does not run (``quantization='gguf'``, speculative decoding)."""
        pc = ParallelConfig(tensor_parallel_size=self.tensor_parallel_size)
        if pc.tensor_parallel_size > 1:
            if self.quantization in ("gguf", "gptq", "awq", "compressed-tensors"):
                raise ValueError(
                    f"quantization={self.quantization!r} is not supported with tensor_parallel_size > 1 "
                    "(its weights stay in quantized blocks, which are not sharded); use "
                    "quantization='int8' or quantization='int4' on a float checkpoint, or none."
                )
            if self.speculative_config:
                raise ValueError("speculative_config is not supported with tensor_parallel_size > 1.")
            if self.enable_lora:
                raise ValueError("enable_lora is not supported with tensor_parallel_size > 1.")
        return pc

    @classmethod
    def field_names(cls) -> list:
        return [f.name for f in fields(cls)]

    def create_speculative_config(self) -> SpeculativeConfig | None:
        """The parsed ``speculative_config`` (None = off). Raises ValueError naming the field."""
        return SpeculativeConfig.from_value(self.speculative_config)

    def create_lora_config(self) -> LoRAConfig | None:
        """The ``LoRAConfig`` when ``enable_lora`` (None otherwise). Raises ValueError naming the field."""
        if not self.enable_lora:
            return None
        return LoRAConfig(
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
            max_slot_preemptions=self.max_slot_preemptions,
        )

    def create_configs(self, model_max_len: int, sliding_window: int | None = None):
        """Returns ``(ModelConfig, CacheConfig, SchedulerConfig)``; with ``speculative_config``
        the scheduler config reserves ``num_speculative_tokens`` lookahead slots per decode
        (``create_speculative_config`` gives the rest).

        Raises:
            ValueError: if ``max_model_len`` exceeds the model's ``max_position_embeddings``
                or any field is out of range.
        """
        max_len = self.max_model_len or model_max_len
        if max_len > model_max_len:
            raise ValueError(
                f"max_model_len={max_len} is larger than the model's max_position_embeddings={model_max_len}."
            )
        model_config = ModelConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            seed=self.seed,
            max_model_len=max_len,
            quantization=self.quantization,
            model_impl=self.model_impl,
        )
        # On CPU a step's cost grows with its tokens and the GEMMs are most efficient at ~2-3k
        # rows, so (as vLLM's CPU backend) prompts are chunked into 2,048-token steps mixed with
        # decodes: first tokens stream out while later prompts prefill (docs/benchmarks.md).
        # CUDA keeps vLLM V0's default: whole prompts, budget = max_model_len.
        spec = self.create_speculative_config()
        on_cpu = model_config.resolved_device() == "cpu"
        chunked = on_cpu if self.enable_chunked_prefill is None else self.enable_chunked_prefill
        budget = self.max_num_batched_tokens
        if budget is None and chunked and on_cpu:
            # Under ``fair`` a newcomer's first token waits for the step in flight: a 2,048-token
            # step lasts seconds on a CPU, longer than the newcomer's own prefill. Short steps
            # bound that wait at little cost: a few hundred rows already keep the GEMMs efficient.
            budget = FAIR_CPU_CHUNKED_PREFILL_TOKENS if self.policy == "fair" else CPU_CHUNKED_PREFILL_TOKENS
        cache_config = CacheConfig(
            block_size=self.block_size,
            num_gpu_blocks=self.num_gpu_blocks,
            kv_cache_memory_gib=self.kv_cache_memory_gib,
            num_cpu_blocks=self.num_cpu_blocks,
            swap_space_gib=self.swap_space_gib,
            sliding_window=sliding_window,
            enable_prefix_caching=self.enable_prefix_caching,
            waiting_aware_eviction=self.waiting_aware_eviction,
            kv_offload_gib=self.kv_offload_gib,
            num_kv_offload_blocks=self.num_kv_offload_blocks,
            kv_offload_dir=self.kv_offload_dir,
            kv_offload_disk_gib=self.kv_offload_disk_gib,
            watermark=self.watermark,
            gpu_memory_utilization=self.gpu_memory_utilization,
            cache_dtype=self.kv_cache_dtype,
        )
        if budget is None:
            budget = SchedulerConfig.default_max_num_batched_tokens(chunked, max_len)
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_len,
            chunked_prefill_enabled=chunked,
            preemption_mode=SchedulerConfig.parse_preemption_mode(self.preemption_mode),
            policy=self.policy,
            fair_input_weight=self.fair_input_weight,
            fair_output_weight=self.fair_output_weight,
            tenant_weights=parse_tenant_weights(self.tenant_weights),
            fair_burst_tokens=self.fair_burst_tokens,
            scheduling_backfill=self.scheduling_backfill,
            max_num_partial_prefills=self.max_num_partial_prefills,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_decode_slowdown=self.max_decode_slowdown,
            max_waiting=self.max_waiting,
            delay_factor=self.delay_factor,
            num_lookahead_slots=spec.num_speculative_tokens if spec else 0,
            spec_decode_disable_by_batch_size=spec.disable_by_batch_size if spec else None,
        )
        return model_config, cache_config, scheduler_config
