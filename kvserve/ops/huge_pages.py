"""Packed CPU weights in memory backed by 2 MiB pages (Linux transparent huge pages).

Why: a decode step is bound by streaming every weight once. With 4 KiB pages the stream
crosses a page every 4 KiB: a TLB entry each, and the hardware prefetchers stop at every page
boundary. 2 MiB pages remove both (figures: docs/benchmarks.md, CPU kernels).

Hosts whose transparent huge pages are ``madvise`` (common; ``never`` turns them off) give
huge pages only to memory that asks: torch's allocator does not (except under
``THP_MEM_ALLOC_ENABLE=1``, and then only for single allocations of 2 MiB or more, which most
weights are not). So the weights are copied into one anonymous mapping advised
``MADV_HUGEPAGE`` (``madvise(2)``). Where that is unavailable (not Linux, THP ``never``, the
call fails) or ``KVSERVE_HUGE_PAGES=0``, nothing moves: the result is the same, only slower.
"""

from __future__ import annotations

import mmap
from typing import TypeGuard

import torch

from kvserve import envs

HUGE_PAGE = 1 << 21
#: Each tensor starts on a 4 KiB boundary (the kernels need 64 bytes).
ALIGN = 4096
#: Tensors smaller than this stay where they are (norms, biases: not streamed at scale).
MIN_BYTES = 64 * 1024
ENV = "KVSERVE_HUGE_PAGES"


def enabled() -> bool:
    """False when ``KVSERVE_HUGE_PAGES=0`` or the platform has no ``MADV_HUGEPAGE``."""
    return envs.KVSERVE_HUGE_PAGES and hasattr(mmap, "MADV_HUGEPAGE")


def _arena(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` uint8, starting on a 2 MiB boundary, in a mapping advised MADV_HUGEPAGE;
    None where the advice is refused. The tensor keeps the mapping alive."""
    size = (nbytes + 2 * HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        mm.close()
        return None
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    start = (-buf.data_ptr()) % HUGE_PAGE
    return buf[start : start + nbytes]


def _movable(t: object) -> TypeGuard[torch.Tensor]:
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and t.numel() * t.element_size() >= MIN_BYTES
    )


def move_weights(holders: list[object], attrs: tuple[str, ...]) -> int:
    """Copy the large CPU tensors found at ``holder.<attr>`` into one huge-page mapping and
    point the holders at the copies (same dtype, shape and bytes).

    Args:
        holders: objects owning the weights (packed-weight objects: ``AmxWeight``,
            ``PanelWeight``); attributes missing or not a contiguous strided CPU tensor of at
            least ``MIN_BYTES`` are skipped.
        attrs: the attribute names to look at on each holder.

    Returns:
        bytes moved (0 when disabled, refused, or nothing qualified).

    Call before any kernel keeps a tensor's address (native step plans are built at the first
    step, so after loading is safe).
    """
    if not enabled():
        return 0
    # holders that share a tensor (contiguous: address, dtype and shape say which) share its copy
    groups: dict[tuple, list[tuple[object, str]]] = {}
    sizes: dict[tuple, int] = {}
    for h in holders:
        for a in attrs:
            t = getattr(h, a, None)
            if _movable(t):
                k = (t.data_ptr(), t.dtype, tuple(t.shape))
                groups.setdefault(k, []).append((h, a))
                sizes[k] = (t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN
    if not groups:
        return 0
    arena = _arena(sum(sizes.values()))
    if arena is None:
        return 0
    pos = 0
    for k, owners in groups.items():
        h0, a0 = owners[0]
        t = getattr(h0, a0)
        dst = arena[pos : pos + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        dst.copy_(t)
        # each original is released as soon as it is copied (no list keeps it): the move
        # needs the arena plus one tensor, not twice the weights (a 1B float32 model's
        # 6 GB of panels would otherwise peak at 12 GB)
        del t
        for h, a in owners:
            setattr(h, a, dst)
        pos += sizes[k]
    return pos
