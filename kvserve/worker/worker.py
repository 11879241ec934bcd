"""The executor the engine talks to: loads the model, sizes and owns the KV cache, runs steps."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from kvserve import envs
from kvserve.config import CacheConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kvserve.lora_request import LoRARequest
from kvserve.ops import library
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import (
    BlockMoveError,
    CompletionSequenceGroupOutput,
    ExecuteModelRequest,
    SequenceData,
    SequenceGroupMetadata,
)
from kvserve.worker.cache_engine import CacheEngine, bytes_per_block
from kvserve.worker.cpu_malloc import keep_freed_memory, return_freed_memory
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.tp_executor import PeerError, TensorParallelPeers, for_peers, threads_per_rank

_GIB = 1 << 30
logger = logging.getLogger(__name__)

#: Seconds the driver waits for its peers' answers after its own part of a step raised
#: (they answer at once unless stuck in an all-reduce the driver never reached).
PEER_SETTLE_S = 10.0

#: What sleep mode puts away and ``wake_up`` can bring back separately (vLLM's tags).
SLEEP_TAGS = ("weights", "kv_cache")


#: Re-measure the best CPU thread count after this many steps or seconds, whichever comes
#: first (the machine's load changes; a calibration is a few small GEMMs).
RECALIBRATE_EVERY_STEPS = 256
RECALIBRATE_EVERY_S = 20.0


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class ThreadChoice:
    """A thread count and why it was chosen (``kvserve doctor`` prints both)."""

    num_threads: int
    reason: str


def calibrate_threads(max_threads: int, hidden: int = 576, reps: int = 3) -> int:
    """The torch thread count (``max_threads`` or 1) that runs a small decode-sized GEMM
    workload fastest right now (set as torch's); ``KVSERVE_NUM_THREADS`` overrides.

    OpenMP intra-op parallelism collapses when other processes occupy the cores (a barrier
    waits for a descheduled peer): on a busy machine with few cores one thread can beat
    several, on an idle one several win; which holds is timed, not guessed. Cost: a few
    small GEMMs per count.
    """
    return choose_threads(max_threads, hidden, reps).num_threads


def choose_threads(max_threads: int, hidden: int = 576, reps: int = 3) -> ThreadChoice:
    """``calibrate_threads`` with its reason: the override, a single core, or the two timings."""
    n = envs.KVSERVE_NUM_THREADS
    if n is not None:
        torch.set_num_threads(n)
        return ThreadChoice(n, f"fixed by KVSERVE_NUM_THREADS={n}")
    if max_threads <= 1:
        torch.set_num_threads(1)
        return ThreadChoice(1, "one usable core")

    with torch.inference_mode():
        a = torch.randn(64, hidden)
        w = torch.randn(4 * hidden, hidden)
        best_t = {max_threads: float("inf"), 1: float("inf")}
        # Alternate the two counts, best of each: a passing disturbance (another process's
        # start or exit) then cannot make one count look slower than it is, which would keep
        # a wrong count until the next calibration.
        for _ in range(reps):
            for n in best_t:
                torch.set_num_threads(n)
                torch.nn.functional.linear(a, w)  # warm-up (thread pool resize)
                t = time.perf_counter()
                for _ in range(4):
                    torch.nn.functional.linear(a, w)
                best_t[n] = min(best_t[n], time.perf_counter() - t)
    # prefer more threads unless one thread is clearly faster
    best = 1 if best_t[1] < 0.9 * best_t[max_threads] else max_threads
    torch.set_num_threads(best)
    ms = {n: f"{t * 1e3:.2f} ms" for n, t in best_t.items()}
    why = (
        f"measured a 64-row GEMM: {max_threads} threads {ms[max_threads]}, 1 thread {ms[1]} "
        f"(1 is chosen only when >10% faster: the cores are busy); re-measured every "
        f"{RECALIBRATE_EVERY_STEPS} steps or {RECALIBRATE_EVERY_S:g} s"
    )
    return ThreadChoice(best, why)


def _host_memory_bytes() -> int | None:
    """The machine's physical memory in bytes (None where it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def _host_available_bytes() -> int | None:
    """The host memory the kernel could hand out now without swapping, in bytes
    (``MemAvailable`` of ``/proc/meminfo``; None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _resident_bytes() -> int:
    """This process's resident memory in bytes (``/proc/self/statm``; 0 where unreadable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * int(os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return 0


def kv_budget_bytes(utilization: float, total_bytes: int, used_bytes: int) -> int:
    """KV-cache bytes under ``gpu_memory_utilization``: ``utilization`` x ``total_bytes`` (the
    memory weights and KV share) less ``used_bytes`` (what is held already: weights, runtime),
    as vLLM sizes its pool; may be <= 0."""
    return int(utilization * total_bytes) - int(used_bytes)


class Worker:
    """Model + KV cache on one device.

    Args:
        model_config: ``model`` is a HF directory, or ``None``/``"default"`` (resolved with
            ``resolve_model_dir``); ``resolved_device()`` / ``resolved_dtype()`` pick where
            and how the model runs.
        cache_config: block size, pool sizes (counts or GiB), sliding window.
        scheduler_config: batching limits (unused by the worker beyond validation).
        parallel_config: ``tensor_parallel_size`` T > 1 makes this worker the driver (rank 0)
            of T ranks: it starts ranks 1..T-1 (``tp_executor``), holds its own 1/T shard, and
            forwards every call that touches the model or the cache to the peers; only it
            samples. ``kv_cache_memory_gib`` is then per rank (each rank's blocks hold KH/T
            heads, so the block count grows with T).
        rank, tp_world_size, tp_port: set by ``tp_executor`` for a peer rank only.
        lora_config: multi-LoRA limits (``None``: LoRA off). Adapters are loaded into a CPU
            cache by ``add_lora`` and copied into device slots as steps need them. Not with
            tensor parallelism (the slots hold whole, unsharded adapters).

    Attributes:
        hf_config: the model's transformers config. model_dir: the resolved directory.
        tp: this rank's ``TensorParallelGroup`` (None at T = 1). peers: the driver's
            ``TensorParallelPeers`` (None at T = 1 and on the peers).

    Raises:
        ValueError: bad model path or unsupported architecture (from the loader); a T that
            does not divide the head counts, or more ranks than CUDA devices.
        PeerError: a peer rank failed to start (its message is included).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig | None = None,
        parallel_config: ParallelConfig | None = None,
        *,
        rank: int = 0,
        tp_world_size: int | None = None,
        tp_port: int | None = None,
        lora_config: LoRAConfig | None = None,
    ):
        from kvserve.model_executor.model_loader import (
            check_fallback_settings,
            load_hf_config,
            resolve_model_dir,
        )
        from kvserve.transformers_utils.hf_config import get_sliding_window

        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        from kvserve.worker.parallel_state import TensorParallelGroup, host_store

        self.parallel_config = parallel_config or ParallelConfig(tensor_parallel_size=tp_world_size or 1)
        self.rank = rank
        self.tp_size = self.parallel_config.tensor_parallel_size
        self.is_driver = rank == 0
        self.lora_config = lora_config
        self.lora_manager = None
        if lora_config is not None and self.tp_size > 1:
            raise ValueError(f"enable_lora is not supported with tensor_parallel_size={self.tp_size} (use 1)")
        self.device = model_config.resolved_device()
        self.dtype = model_config.resolved_dtype()
        self._steps = 0
        self._calibrated_at = time.monotonic()
        if self.device == "cpu" and self.tp_size > 1:
            # the ranks share the cores: an even split, fixed (a calibration per rank would
            # measure the others' load)
            torch.set_num_threads(threads_per_rank(_cpu_count(), self.tp_size))
            self.num_threads = torch.get_num_threads()
        else:
            self.num_threads = (
                calibrate_threads(_cpu_count()) if self.device == "cpu" else torch.get_num_threads()
            )
        if self.device == "cpu":
            keep_freed_memory()  # no page faults on every step's activations (see cpu_malloc)
        torch.manual_seed(model_config.seed)
        self.model_dir = resolve_model_dir(model_config.model, model_config.quantization)
        self.hf_config = load_hf_config(self.model_dir, model_config.model_impl)
        #: Whether the transformers fallback runs the model (``model_impl``); what it cannot
        #: run is refused here, before any peer rank starts.
        self.uses_fallback = check_fallback_settings(
            self.hf_config,
            model_config.model_impl,
            self.model_dir,
            model_config.quantization,
            tensor_parallel_size=self.tp_size,
            enable_lora=lora_config is not None,
        )
        self.tp: TensorParallelGroup | None = None
        self.peers: TensorParallelPeers | None = None
        #: Why this driver can run no more steps (its ranks went out of step), or None.
        self.broken: str | None = None
        if self.tp_size > 1:
            if model_config.quantization == "gguf":
                raise ValueError("quantization='gguf' is not supported with tensor_parallel_size > 1.")
            from kvserve.model_executor.quantized_checkpoint import quant_method_of

            method = quant_method_of(self.hf_config)
            if model_config.quantization is None and method is not None:
                # found in config.json (no quantization= given): refused as the setting is,
                # before any peer process starts
                raise ValueError(
                    f"the checkpoint's quantization_config (quant_method {method!r}) is not supported "
                    "with tensor_parallel_size > 1 (its weights stay in quantized blocks, which are "
                    "not sharded); use a float checkpoint (quantization='int8' or "
                    "quantization='int4' quantize it at load)."
                )
            if self.device == "cuda":
                torch.cuda.set_device(rank)  # "cuda" is this rank's device from here on
            store = None  # rank 0 hosts it
            if self.is_driver:
                self.parallel_config.verify_with_model(
                    self.hf_config, self.device, quantization=model_config.quantization
                )
                store = host_store(self.tp_size)
                tp_port = store.port
                self.peers = TensorParallelPeers(
                    self.tp_size, tp_port, Worker, (model_config, cache_config, scheduler_config)
                )
                self.peers.start()
            assert tp_port is not None
            try:
                if self.peers is not None:
                    self.peers.wait_started()
                self.tp = TensorParallelGroup(rank, self.tp_size, tp_port, self.device, store=store)
            except BaseException:
                self.shutdown()
                raise
        if self.device == "cpu":
            # every CPU kernel built (or found in the cache) now: built on first use, a request
            # would wait for the compiler inside an engine step, after the server said ready
            library.load_all()
        try:
            self.model = self._load_weights()
            if self.peers is not None:
                self.peers.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        #: The model's KV shape ``(layers, kv_heads, head_dim)``, kept while the weights sleep.
        self._kv_shape = (self.model.num_layers, self.model.num_kv_heads, self.model.head_dim)
        #: Sleep mode: what is asleep (``SLEEP_TAGS`` members), the sleep level, the KV pool sizes
        #: to allocate again, and (level 1 on CUDA) the weights' host copies.
        self.asleep: set[str] = set()
        self.sleep_level = 0
        self._kv_blocks: tuple[int, int] | None = None
        self._offloaded: list[tuple[torch.Tensor, torch.device]] = []
        #: Attention window (tokens) the runner masks with: the cache config's (the block
        #: manager may recycle blocks outside it) or else the model's own.
        self.sliding_window = cache_config.sliding_window or get_sliding_window(self.hf_config)
        self.cache_engine: CacheEngine | None = None
        self.runner: ModelRunner | None = None
        if lora_config is not None:
            from kvserve.model_executor.quantized_checkpoint import quant_method_of

            quant = model_config.quantization or quant_method_of(self.hf_config)
            if quant is not None:
                raise ValueError(f"enable_lora is not supported with quantization={quant!r}")
            if not getattr(self.model, "supports_lora", True):
                arch = (getattr(self.hf_config, "architectures", None) or [self.hf_config.model_type])[0]
                raise ValueError(
                    f"enable_lora is not supported for {arch} (its layers take no LoRA adapters)"
                )
            from kvserve.lora.manager import LoRAManager
            from kvserve.lora.peft import ModelShapes

            self.lora_manager = LoRAManager(
                self.model, lora_config, ModelShapes.from_hf_config(self.hf_config)
            )

    def _load_weights(self):
        """The model built from the checkpoint (a GGUF file's own blocks, or the safetensors
        directory with its quantization), on this rank's device."""
        from kvserve.model_executor.model_loader import gguf_file_for, load_model

        mc = self.model_config
        if mc.quantization == "gguf":
            from kvserve.model_executor.gguf_loader import load_gguf_model

            gguf_file = gguf_file_for(mc.model)
            assert gguf_file is not None  # resolve_model_dir checked it
            return load_gguf_model(gguf_file, self.dtype, self.device, self.hf_config)
        return load_model(
            self.model_dir,
            self.dtype,
            self.device,
            self.hf_config,
            quantization=mc.quantization,
            tp=self.tp,
            model_impl=mc.model_impl,
        )

    # ------------------------------------------------------------------ sleep mode
    def sleep(self, level: int) -> None:
        """Free the KV cache and put the weights away, on every rank: level 1 offloads them to
        host memory (CUDA: pinned CPU copies; CPU: they already live in host memory and stay
        where they are), level 2 drops them (``wake_up`` reads the checkpoint again). The
        cache's contents are lost: the engine empties its prefix cache first.

        Raises:
            ValueError: ``level`` not 1 or 2, already asleep, ``init_cache`` not called, or
                level 2 with LoRA enabled (the adapter slots are bound to the weights).
            PeerError: (T > 1) a peer rank failed.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}.")
        if self.asleep:
            raise ValueError(f"the worker is already asleep (level {self.sleep_level}); wake_up() first.")
        if self.cache_engine is None:
            raise ValueError("Worker.init_cache() must be called before sleep().")
        if level == 2 and self.lora_manager is not None:
            raise ValueError(
                "sleep level 2 is not supported with enable_lora (the adapter slots are bound to the "
                "weights it drops); use level 1."
            )
        self._on_all_ranks("sleep", level)

    def sleep_local(self, level: int) -> None:
        """``sleep`` on this rank only."""
        assert self.cache_engine is not None
        self._kv_blocks = (self.cache_engine.num_gpu_blocks, self.cache_engine.num_cpu_blocks)
        self.cache_engine = None
        if level == 2:
            self.model = None
            self.runner = None
        elif self.device != "cpu":
            self._offload_weights()
        self.asleep = set(SLEEP_TAGS)
        self.sleep_level = level
        self._release_memory()

    def wake_up(self, tags: tuple[str, ...] = ()) -> None:
        """Bring back what ``sleep`` put away, on every rank: ``tags`` (``weights``,
        ``kv_cache``; empty: both). Weights dropped at level 2 are read from the checkpoint
        again; the KV cache is allocated again with its former block counts, zero-filled.
        Waking what is awake is a no-op.

        Raises:
            ValueError: an unknown tag.
            PeerError: (T > 1) a peer rank failed.
        """
        bad = [t for t in tags if t not in SLEEP_TAGS]
        if bad:
            raise ValueError(f"wake_up tags must be among {list(SLEEP_TAGS)}, got {bad}.")
        self._on_all_ranks("wake_up", tuple(tags))

    def wake_up_local(self, tags: tuple[str, ...] = ()) -> None:
        """``wake_up`` on this rank only."""
        want = set(tags or SLEEP_TAGS) & self.asleep
        if "weights" in want:
            if self.model is None:
                self.model = self._load_weights()
            else:
                self._restore_weights()
            self.asleep.discard("weights")
        if "kv_cache" in want:
            assert self._kv_blocks is not None
            self.cache_engine = self._make_cache_engine(*self._kv_blocks)
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self.sleep_level = 0
            if self.runner is None:
                assert self.cache_engine is not None
                self.runner = self._make_runner(self.cache_engine.num_gpu_blocks)

    def _offload_weights(self) -> None:
        """Move every parameter and buffer of the model to pinned host memory, keeping the
        tensor objects (``_restore_weights`` moves them back)."""
        assert self.model is not None
        self._offloaded = []
        with torch.no_grad():
            seen: set[int] = set()
            for t in [*self.model.parameters(), *self.model.buffers()]:
                if id(t) in seen or t.device.type == "cpu":
                    continue
                seen.add(id(t))
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                host.copy_(t.data)
                self._offloaded.append((t, t.device))
                t.data = host

    def _restore_weights(self) -> None:
        """The weights ``_offload_weights`` moved to host memory, back on their devices."""
        with torch.no_grad():
            for t, device in self._offloaded:
                t.data = t.data.to(device)
        self._offloaded = []

    def _release_memory(self) -> None:
        """Hand what sleep freed back: CUDA's cached blocks, or the host heap's free pages."""
        import gc

        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
        else:
            return_freed_memory()

    # ------------------------------------------------------------------ LoRA
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load (and validate) an adapter into the CPU cache; False if it was loaded already.

        Raises:
            ValueError: LoRA is not enabled, or the adapter is invalid (naming the path / limit).
        """
        return self._loras().add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (CPU cache and device slot); False if it was not loaded."""
        return self._loras().remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        """Ids of the loaded adapters."""
        return self._loras().list_loras()

    def _loras(self):
        if self.lora_manager is None:
            raise ValueError("LoRA is not enabled (enable_lora=False)")
        return self.lora_manager

    # ------------------------------------------------------------------ cache sizing
    def bytes_per_block(self) -> int:
        """KV bytes of one block over all layers (K and V)."""
        layers, kv_heads, head_dim = self._kv_shape
        return bytes_per_block(
            layers,
            self.cache_config.block_size,
            kv_heads,
            head_dim,
            self.dtype,
            self.cache_config.cache_dtype,
        )

    def determine_num_blocks(self) -> tuple[int, int]:
        """``(num_gpu_blocks, num_cpu_blocks)``: explicit counts in ``CacheConfig`` win, else
        ``kv_cache_memory_gib`` / ``swap_space_gib`` divided by ``bytes_per_block()``.

        Raises:
            ValueError: the device pool would hold no block, or (CUDA) it does not fit in free
                device memory.
        """
        cc = self.cache_config
        bpb = self.bytes_per_block()
        if cc.num_gpu_blocks is not None:
            gpu = cc.num_gpu_blocks
        elif cc.gpu_memory_utilization is not None:
            gpu = self._blocks_for_utilization(cc.gpu_memory_utilization, bpb)
        else:
            gpu = int(cc.kv_cache_memory_gib * _GIB // bpb)
            if gpu < 1:
                raise ValueError(
                    f"kv_cache_memory_gib={cc.kv_cache_memory_gib} is smaller than one KV block ({bpb} bytes)"
                )
        cpu = cc.num_cpu_blocks if cc.num_cpu_blocks is not None else int(cc.swap_space_gib * _GIB // bpb)
        tier = (
            cc.num_kv_offload_blocks
            if cc.num_kv_offload_blocks is not None
            else int(cc.kv_offload_gib * _GIB // bpb)
        )
        self._check_host_memory(gpu, cpu, bpb, tier)
        if self.device == "cuda":
            free, _ = torch.cuda.mem_get_info()
            if gpu * bpb > free:
                raise ValueError(
                    f"the KV cache needs {gpu * bpb / _GIB:.2f} GiB ({gpu} blocks) but only "
                    f"{free / _GIB:.2f} GiB of device memory is free; lower kv_cache_memory_gib "
                    "or num_gpu_blocks"
                )
        return gpu, cpu

    def _blocks_for_utilization(self, utilization: float, bpb: int) -> int:
        """Device-pool blocks for ``gpu_memory_utilization``: ``kv_budget_bytes`` of this
        device's memory (CUDA: the device's total and torch's reserved bytes; CPU: physical
        host memory, shared by the ranks, and this process's resident set) over ``bpb``.

        Raises:
            ValueError: the budget holds no block (naming the setting and the figures).
        """
        if self.device == "cuda":
            _, total = torch.cuda.mem_get_info()
            used = torch.cuda.memory_reserved()
        else:
            host = _host_memory_bytes()
            if host is None:
                raise ValueError(
                    "gpu_memory_utilization needs the host's memory size, which cannot be read here"
                )
            total, used = host // self.tp_size, _resident_bytes()
        budget = kv_budget_bytes(utilization, total, used)
        if budget < bpb:
            raise ValueError(
                f"gpu_memory_utilization={utilization} leaves {max(budget, 0) / _GIB:.2f} GiB for the KV "
                f"cache ({utilization} x {total / _GIB:.2f} GiB less {used / _GIB:.2f} GiB already held), "
                f"less than one block ({bpb} bytes); raise it or set kv_cache_memory_gib"
            )
        return budget // bpb

    def _check_host_memory(self, gpu: int, cpu: int, bpb: int, tier: int = 0) -> None:
        """Refuse pools that host memory cannot hold (the swap pool and the prefix cache's
        host tier, ``tier`` blocks, always; the device pool too on CPU; every rank holds its
        own shard of each), naming the setting to lower,
        rather than fail in the allocator. Physical memory is the bound (not what is free
        now: that moves with the other processes of the machine).

        Raises:
            ValueError: the host pools exceed the machine's physical memory.
        """
        total = _host_memory_bytes()
        if total is None:
            return
        cc = self.cache_config
        on_host = [(cpu, "num_cpu_blocks" if cc.num_cpu_blocks is not None else "swap_space_gib")]
        if tier:
            on_host.append(
                (tier, "num_kv_offload_blocks" if cc.num_kv_offload_blocks is not None else "kv_offload_gib")
            )
        if self.device == "cpu":
            on_host.insert(
                0, (gpu, "num_gpu_blocks" if cc.num_gpu_blocks is not None else "kv_cache_memory_gib")
            )
        need = sum(n for n, _ in on_host) * bpb * self.tp_size
        if need <= total:
            self._warn_over_available(need, [name for n, name in on_host if n])
            return
        # name the pool that is over the bound by itself, else both
        over = [name for n, name in on_host if n * bpb * self.tp_size > total] or [
            name for _, name in on_host
        ]
        ranks = f", on each of {self.tp_size} ranks" if self.tp_size > 1 else ""
        pools = f"{gpu} blocks + {cpu} swap blocks" if self.device == "cpu" else f"{cpu} swap blocks"
        if tier:
            pools += f" + {tier} host-tier blocks"
        raise ValueError(
            f"the KV cache needs {need / _GIB:.2f} GiB of host memory ({pools} of {bpb} bytes{ranks}) but this machine has {total / _GIB:.2f} GiB of host memory; "
            f"lower {' or '.join(over)}"
        )

    def _warn_over_available(self, need: int, settings: list[str]) -> None:
        """Log a WARNING when the host pools (``need`` bytes) exceed the memory available now:
        they fit the machine, but the pages are written as the pools are made, so on a host
        shared with other processes the kernel may kill this one. Not an error: what is
        available moves with the other processes, physical memory is the bound."""
        available = _host_available_bytes()
        if available is None or need <= available:
            return
        cc = self.cache_config
        if self.device == "cpu" and cc.num_gpu_blocks is None and cc.gpu_memory_utilization is not None:
            # the device pool's size came from the utilization, which on CPU is of host memory
            settings = [
                "gpu_memory_utilization (on CPU a fraction of the machine's physical memory)"
                if name == "kv_cache_memory_gib"
                else name
                for name in settings
            ]
        logger.warning(
            "the KV cache's host pools need %.2f GiB but only %.2f GiB of host memory is available "
            "now; the kernel may kill this process when memory runs out: lower %s",
            need / _GIB,
            available / _GIB,
            " or ".join(settings),
        )

    def _on_all_ranks(self, method: str, *args):
        """Run ``self.<method>_local(*args)`` here and (driver at T > 1) on every peer with the
        same arguments (``peer_args`` if given), then wait for the peers; returns the local
        result.

        Raises:
            the local exception (after the peers answered), else PeerError naming the peers
            that failed, died or hung.
        """
        local = getattr(self, method + "_local")
        if self.peers is None:
            return local(*args)
        if self.broken:
            raise PeerError(self.broken)
        peer_args = (for_peers(args[0]),) if method == "execute_model" else args
        self.peers.send(method + "_local", *peer_args)
        try:
            out = local(*args)
        except BaseException as e:
            # The peers normally fail the same way (bad input reaches every rank) or have
            # finished (the driver failed while sampling). If they do not answer soon, the
            # driver failed inside the forward and they wait in an all-reduce it will never
            # join: the ranks are out of step for good, so stop them (bounded, and every
            # later step fails at once naming the cause) rather than wait out the timeout.
            try:
                self.peers.collect(PEER_SETTLE_S)
            except PeerError as pe:
                logger.error("tensor-parallel ranks out of step after %r on the driver: %s", e, pe)
                try:
                    self.peers.check_alive()
                    self.broken = (
                        f"the tensor-parallel ranks went out of step when the driver failed inside a "
                        f"forward ({type(e).__name__}: {e}); restart the engine"
                    )
                except PeerError as dead:  # the driver failed because a peer died: name it
                    self.broken = str(dead)
                self.peers.shutdown()
            raise
        errors = self.peers.collect(self._peer_timeout())
        if errors:
            raise PeerError(f"{method} failed on tensor-parallel worker(s): " + "; ".join(errors))
        return out

    def dead_reason(self) -> str | None:
        """Why this driver can run no more steps (a peer rank exited, or the ranks went out of
        step), or None (always None at T = 1)."""
        if self.broken:
            return self.broken
        if self.peers is not None:
            try:
                self.peers.check_alive()
            except PeerError as e:
                return str(e)
        return None

    @staticmethod
    def _peer_timeout() -> float:
        from kvserve.worker.parallel_state import collective_timeout_s

        return collective_timeout_s()

    def time_all_reduce(self, rows: int, reps: int = 20) -> float:
        """Mean seconds of one all-reduce of a ``[rows, hidden_size]`` activation over the
        ranks, all of them doing nothing else (the transfer cost alone, for the benchmark);
        0.0 at T = 1."""
        return self._on_all_ranks("time_all_reduce", rows, reps)

    def time_all_reduce_local(self, rows: int, reps: int = 20) -> float:
        """``time_all_reduce`` on this rank."""
        if self.tp is None:
            return 0.0
        x = torch.zeros(rows, self.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        self.tp.barrier()
        t = time.perf_counter()
        for _ in range(reps):
            self.tp.all_reduce(x)
        dt = (time.perf_counter() - t) / reps
        self.tp.stats.reset()
        return dt

    def time_gather(self, rows: int, reps: int = 20) -> float:
        """Mean seconds of one gather of a ``[rows, vocab / T]`` float32 logits slice from every
        rank to the driver, all ranks doing nothing else (the LM head's transfer alone, for the
        benchmark); 0.0 at T = 1."""
        return self._on_all_ranks("time_gather", rows, reps)

    def time_gather_local(self, rows: int, reps: int = 20) -> float:
        """``time_gather`` on this rank."""
        if self.tp is None:
            return 0.0
        x = torch.zeros(rows, self.model.vocab_shard.rows, dtype=torch.float32, device=self.device)
        self.tp.barrier()
        t = time.perf_counter()
        for _ in range(reps):
            self.tp.gather(x)
        dt = (time.perf_counter() - t) / reps
        self.tp.gather_stats.reset()
        return dt

    # ------------------------------------------------------------------ disk tier
    def open_disk_tier(self, directory: str, max_bytes: int) -> None:
        """Start the prefix cache's disk tier (``worker.disk_tier``) for this worker's host
        blocks, keyed to the model, its checkpoint files (names, sizes, modification times:
        weights rewritten in place do not reuse the old blocks), quantization, dtype, KV dtype
        and block shape. One rank only.

        Raises:
            ValueError: tensor parallelism, or ``init_cache`` not called.
        """
        from kvserve.worker.disk_tier import DiskTier, checkpoint_fingerprint

        if self.tp_size > 1:
            raise ValueError(f"kv_offload_dir needs tensor_parallel_size=1, got {self.tp_size}")
        if self.cache_engine is None:
            raise ValueError("Worker.init_cache() must be called before open_disk_tier().")
        ce = self.cache_engine
        # a block as the pools hold it: rows of head_dim (+ 2 scale bytes when quantized)
        shape = (ce.num_layers, 2, ce.num_kv_heads, ce.block_size, ce.device_cache.shape[-1])
        mc = self.model_config
        weights = checkpoint_fingerprint(self.model_dir, mc.model)
        identity = (
            f"{mc.model}|{weights}|q={mc.quantization}|impl={mc.model_impl}|{self.dtype}"
            f"|kv={ce.storage_dtype}|{shape}"
        )
        self.disk_tier = DiskTier(directory, identity, shape, ce.device_cache.dtype, max_bytes)
        self._disk_loaded: dict[int, torch.Tensor] = {}

    def read_disk_tier(self, limit: int) -> list[int]:
        """Read up to ``limit`` valid block files (least recently used first); returns their
        keys. The bytes wait for ``fill_host_blocks``."""
        items = self.disk_tier.load(limit)
        self._disk_loaded = dict(items)
        return [k for k, _ in items]

    def fill_host_blocks(self, placed: dict[int, int]) -> None:
        """Copy blocks read by ``read_disk_tier`` into host blocks: ``{key: host block}``."""
        assert self.cache_engine is not None
        cpu = self.cache_engine.cpu_cache
        for key, c in placed.items():
            cpu[:, :, :, c] = self._disk_loaded[key]
        self._disk_loaded = {}

    def save_host_blocks(self, blocks: list[tuple[int, int]]) -> None:
        """Queue host blocks for the disk tier: ``(host block, key)`` pairs; the bytes are
        copied now, the files written by its thread."""
        assert self.cache_engine is not None
        cpu = self.cache_engine.cpu_cache
        for c, key in blocks:
            self.disk_tier.save(key, cpu[:, :, :, c])

    def shutdown(self) -> None:
        """Stop the peer ranks (T > 1) and drop the group; idempotent, a no-op at T = 1. A disk
        tier writes what it has queued first."""
        tier = getattr(self, "disk_tier", None)
        if tier is not None:
            tier.close()
        if self.peers is not None:
            self.peers.shutdown()
        self.close_group()

    def close_group(self) -> None:
        """Drop this rank's tensor-parallel group (its sockets close)."""
        if self.tp is not None:
            self.tp.close()

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the KV cache (zero-filled) and the model runner, on every rank.

        Raises:
            PeerError: a peer rank failed to allocate its shard of the cache.
        """
        self._on_all_ranks("init_cache", num_gpu_blocks, num_cpu_blocks)

    def init_cache_local(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """``init_cache`` on this rank only."""
        self.cache_engine = self._make_cache_engine(num_gpu_blocks, num_cpu_blocks)
        self.runner = self._make_runner(num_gpu_blocks)

    def _make_cache_engine(self, num_gpu_blocks: int, num_cpu_blocks: int) -> CacheEngine:
        layers, kv_heads, head_dim = self._kv_shape
        return CacheEngine(
            layers,
            kv_heads,
            head_dim,
            self.cache_config.block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            self.dtype,
            self.device,
            self.cache_config.cache_dtype,
        )

    def _make_runner(self, num_gpu_blocks: int) -> ModelRunner:
        from kvserve.model_executor.sampler import Sampler

        eos = getattr(self.hf_config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        runner = ModelRunner(
            self.model,
            self.cache_config.block_size,
            num_gpu_blocks,
            self.sliding_window,
            Sampler(eos_token_id=eos),
            self.device,
            cache_dtype=self.cache_config.cache_dtype,
        )
        runner.lora_manager = self.lora_manager
        return runner

    def warm_up(self) -> float:
        """Run one throw-away prefill step of ``max_num_batched_tokens`` tokens (at most
        ``max_model_len`` and the cache's slots) so that the first real step does not pay one-time
        costs: oneDNN's primitive creation for that row count, page faults of a step's first
        activations, the native kernels' per-thread scratch. vLLM warms up with a dummy run the
        same way. Its K/V land in blocks the block manager has not handed out yet; they are
        written again before anything reads them. Then every other row bucket a step can meet gets its oneDNN primitives
        (``warm_row_buckets``, which lengthens start-up; docs/benchmarks.md).

        Skipped for float32 on CPU: its GEMMs are our own kernel (no oneDNN primitives), so its
        first steps gain nothing from it, while it would lengthen start-up.

        Returns:
            seconds taken (0.0 when skipped, or with no scheduler config or cache).
        Raises:
            RuntimeError: ``init_cache`` was not called.
        """
        return self._on_all_ranks("warm_up")

    def warm_up_local(self) -> float:
        """``warm_up`` on this rank only (the peers run the same forward, without sampling)."""
        if self.cache_engine is None or self.runner is None:
            raise RuntimeError("Worker.init_cache() must be called before warm_up()")
        if self.device == "cpu" and self.dtype == torch.float32:
            return 0.0
        sc = self.scheduler_config
        bs = self.cache_config.block_size
        n = (
            0
            if sc is None
            else min(sc.max_num_batched_tokens, sc.max_model_len, self.runner.num_gpu_blocks * bs)
        )
        if n <= 0:
            return 0.0
        t = time.perf_counter()
        data = SequenceData([i % self.hf_config.vocab_size for i in range(n)])
        md = SequenceGroupMetadata(
            "warm-up",
            True,
            {0: data},
            SamplingParams(max_tokens=1, temperature=0.0),
            {0: list(range(-(-n // bs)))},
            token_chunk_size=n,
        )
        self._run([md])
        warm_buckets = getattr(self.model, "warm_row_buckets", None)
        if sc is not None and warm_buckets is not None:
            # later steps' other row counts; from about a thousand rows a primitive's build is
            # small beside the step itself, so 4,096 bounds the work
            warm_buckets(min(sc.max_num_batched_tokens, 4096))
        return time.perf_counter() - t

    # ------------------------------------------------------------------ step
    def execute_model(self, req: ExecuteModelRequest) -> list[CompletionSequenceGroupOutput]:
        """Apply swap-out, swap-in, copy; then forward the scheduled tokens and sample.

        Returns one ``CompletionSequenceGroupOutput`` per ``req.seq_group_metadata_list`` entry.

        Raises:
            RuntimeError: ``init_cache`` was not called.
            BlockMoveError: applying the swaps or copies failed (nothing was run). Any other
                exception comes from preparing, running or sampling the forward, after the block
                moves were applied: the engine may then re-run groups of the batch without them.
            PeerError: (T > 1) a peer rank died, hung or failed this step.
        """
        return self._on_all_ranks("execute_model", req)

    def execute_model_local(self, req: ExecuteModelRequest) -> list[CompletionSequenceGroupOutput]:
        """``execute_model`` on this rank only (a peer runs the forward and its LM head slice,
        and returns ``[]``)."""
        self.apply_block_moves(req)
        if not req.seq_group_metadata_list:
            return []
        self.before_step()
        return self._run(req.seq_group_metadata_list)

    def _run(self, metadata: list[SequenceGroupMetadata]) -> list[CompletionSequenceGroupOutput]:
        """Forward ``metadata`` on this rank; the driver also samples (peers compute their
        vocabulary slice of the same logits for the driver's gather, and return ``[]``)."""
        assert self.runner is not None and self.cache_engine is not None
        if self.is_driver:
            return self.runner.execute(metadata, self.cache_engine.gpu_cache)
        inp, hidden = self.runner.forward(metadata, self.cache_engine.gpu_cache)
        if inp is not None and hidden is not None:
            self.runner.logits(inp, hidden)
        return []

    def apply_block_moves(self, req: ExecuteModelRequest) -> None:
        """Apply ``req``'s swap-out, swap-in, then copies to the KV cache.

        Raises:
            RuntimeError: ``init_cache`` was not called.
            BlockMoveError: a move failed.
        """
        if self.asleep:
            raise RuntimeError(f"the worker is asleep ({', '.join(sorted(self.asleep))}); wake_up() first")
        if self.cache_engine is None or self.runner is None:
            raise RuntimeError("Worker.init_cache() must be called before execute_model()")
        try:
            with torch.inference_mode():
                self.cache_engine.swap_out(req.blocks_to_swap_out)
                self.cache_engine.swap_in(req.blocks_to_swap_in)
                self.cache_engine.copy(req.blocks_to_copy)
        except Exception as e:
            raise BlockMoveError(f"applying the step's block moves failed: {e!r}") from e

    def before_step(self) -> None:
        """Per-step housekeeping before a forward (periodic CPU thread re-calibration)."""
        self._steps += 1
        if (
            self.device == "cpu"
            and self.tp_size == 1
            and (
                self._steps >= RECALIBRATE_EVERY_STEPS
                or time.monotonic() - self._calibrated_at >= RECALIBRATE_EVERY_S
            )
        ):
            self.num_threads = calibrate_threads(_cpu_count())
            self._steps, self._calibrated_at = 0, time.monotonic()
