"""The paged KV cache: device blocks, CPU swap blocks, and block swap/copy.

Layout (one tensor for all layers, so swaps and copies are one indexed copy each)::

    device_cache: [num_layers, 2, num_kv_heads, num_gpu_blocks, block_size, head_dim]
    cpu_cache:    [num_layers, 2, num_kv_heads, num_cpu_blocks, block_size, head_dim]

``device_cache[l]`` is layer ``l``'s cache as ``PagedAttention`` expects it (``[0]`` = K,
``[1]`` = V). Heads come before blocks so that gathering a sequence's blocks per head yields
``[kv_heads, tokens, head_dim]`` contiguously (see ``layers.attention``).

A quantized cache (``cache_dtype`` int8 / fp8, ``layers.kv_quant``) has the same layout with
rows of ``head_dim + 2`` one-byte elements: the codes, then the row's float16 scale. The pools
are int8 (bytes); ``gpu_cache`` views them as the storage dtype (int8, float8_e4m3fn,
float8_e5m2), so a layer knows its cache's format by dtype. Scales are part of their rows, so
swaps and copies move them with the codes.

Both pools are zero-filled (unused slots must hold finite values: masked attention weights
are exactly 0, and ``0 * NaN`` would poison the output). Zero pages are mapped lazily by
the OS, so untouched blocks cost no resident memory on CPU.
"""

from __future__ import annotations

import torch

from kvserve.model_executor.layers.kv_quant import row_width, storage_dtype


def bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: str = "auto",
) -> int:
    """Bytes of one KV block across all layers: ``2 * layers * block_size * kv_heads * row``,
    a row being ``head_dim`` elements of ``dtype`` (``cache_dtype`` ``auto``) or ``head_dim + 2``
    bytes (quantized: codes and the float16 scale, ``layers.kv_quant``).

    Raises:
        ValueError: an unknown ``cache_dtype``.
    """
    sd = storage_dtype(cache_dtype, dtype)
    elem = torch.empty((), dtype=sd).element_size()
    return 2 * num_layers * block_size * num_kv_heads * row_width(head_dim, sd) * elem


class CacheEngine:
    """Owns the KV-cache tensors.

    Args:
        num_layers, num_kv_heads, head_dim: model shape.
        block_size: tokens per block.
        num_gpu_blocks: blocks in the device pool (on ``device``, "gpu" also on CPU runs).
        num_cpu_blocks: blocks in the CPU swap pool (may be 0).
        dtype: the model dtype; device: ``"cpu"`` / ``"cuda"``.
        cache_dtype: ``auto`` (K/V in ``dtype``) or a quantized ``kv_cache_dtype`` (``int8``,
            ``fp8_e4m3``, ``fp8_e5m2``: see the module doc).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: str,
        cache_dtype: str = "auto",
    ):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.dtype = dtype
        self.cache_dtype = cache_dtype
        #: What the rows hold: ``dtype``, or the codes' dtype of a quantized cache.
        self.storage_dtype = storage_dtype(cache_dtype, dtype)
        quantized = self.storage_dtype != dtype
        pool_dtype = torch.int8 if quantized else dtype
        self.device = torch.device(device)
        shape = (num_layers, 2, num_kv_heads)
        tail = (block_size, row_width(head_dim, self.storage_dtype))
        self.device_cache = torch.zeros(*shape, num_gpu_blocks, *tail, dtype=pool_dtype, device=self.device)
        pin = self.device.type == "cuda"
        self.cpu_cache = torch.zeros(
            *shape,
            num_cpu_blocks,
            *tail,
            dtype=pool_dtype,
            device="cpu",
            pin_memory=pin and num_cpu_blocks > 0,
        )
        #: Per-layer views ``[2, kv_heads, num_gpu_blocks, block_size, row]`` of
        #: ``storage_dtype`` (row = ``head_dim``, or ``head_dim + 2`` bytes when quantized).
        self.gpu_cache: list[torch.Tensor] = [
            t.view(self.storage_dtype) if quantized else t for t in self.device_cache.unbind(0)
        ]

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype, self.cache_dtype
        )

    def _check(self, ids: list[int], n: int, pool: str) -> None:
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"{pool} block ids {bad[:5]} out of range [0, {n})")

    def _move_blocks(
        self,
        mapping: dict[int, int],
        src_cache: torch.Tensor,
        dst_cache: torch.Tensor,
        src_pool: str,
        dst_pool: str,
    ) -> None:
        """``dst_cache[..., mapping[b], ...] = src_cache[..., b, ...]`` for every block ``b``, as
        one indexed copy over all layers (blocks are dim 3 of both caches)."""
        if not mapping:
            return
        src, dst = list(mapping.keys()), list(mapping.values())
        self._check(src, src_cache.shape[3], src_pool)
        self._check(dst, dst_cache.shape[3], dst_pool)
        si = torch.tensor(src, dtype=torch.long, device=src_cache.device)
        di = torch.tensor(dst, dtype=torch.long, device=dst_cache.device)
        # Host-to-device may be asynchronous (the stream orders it); device-to-host must not be,
        # or the CPU would read the copy before it lands.
        dst_cache[:, :, :, di] = src_cache[:, :, :, si].to(
            dst_cache.device, non_blocking=dst_cache.device.type != "cpu"
        )

    def swap_out(self, mapping: dict[int, int]) -> None:
        """Copy device blocks to CPU blocks: ``{device_block: cpu_block}``.

        Raises:
            ValueError: a block id outside its pool.
        """
        self._move_blocks(mapping, self.device_cache, self.cpu_cache, "device", "cpu")

    def swap_in(self, mapping: dict[int, int]) -> None:
        """Copy CPU blocks to device blocks: ``{cpu_block: device_block}``.

        Raises:
            ValueError: a block id outside its pool.
        """
        self._move_blocks(mapping, self.cpu_cache, self.device_cache, "cpu", "device")

    def copy(self, mapping: dict[int, list[int]]) -> None:
        """Copy device blocks within the device pool: ``{src_block: [dst_block, ...]}``
        (copy-on-write of shared blocks).

        Raises:
            ValueError: a block id outside the pool.
        """
        if not mapping:
            return
        src: list[int] = []
        dst: list[int] = []
        for s, ds in mapping.items():
            for d in ds:
                src.append(s)
                dst.append(d)
        if not src:
            return
        self._check(src + dst, self.num_gpu_blocks, "device")
        si = torch.tensor(src, dtype=torch.long, device=self.device)
        di = torch.tensor(dst, dtype=torch.long, device=self.device)
        self.device_cache[:, :, :, di] = self.device_cache[:, :, :, si]
