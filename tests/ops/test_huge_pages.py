"""Packed weights moved into huge-page memory (``huge_pages.move_weights``): same bytes, new
addresses, and the model's greedy output is unchanged."""

import gc
import weakref

import pytest
import torch

from kvserve.ops import huge_pages


class _Holder:
    def __init__(self, **tensors):
        self.__dict__.update(tensors)


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "1")
    if not huge_pages.enabled():
        pytest.skip("no MADV_HUGEPAGE on this platform")


def test_large_tensors_move_with_their_bytes_and_small_ones_stay(on):
    big = torch.randn(300, 257, dtype=torch.bfloat16)  # 154 KB: moves
    f32 = torch.randn(70, 300)  # 84 KB: moves
    small = torch.randn(64)  # stays
    h = _Holder(tiles=big.clone(), panels=f32.clone(), norm=small)
    moved = huge_pages.move_weights([h], ("tiles", "panels", "norm"))
    if moved == 0:
        pytest.skip("the kernel refused MADV_HUGEPAGE")
    assert moved >= big.numel() * 2 + f32.numel() * 4
    assert torch.equal(h.tiles, big) and torch.equal(h.panels, f32)
    assert h.tiles.dtype == torch.bfloat16 and h.tiles.shape == big.shape and h.tiles.is_contiguous()
    assert h.tiles.data_ptr() % huge_pages.ALIGN == 0 and h.panels.data_ptr() % huge_pages.ALIGN == 0
    # one mapping: the second tensor follows the first
    assert 0 < h.panels.data_ptr() - h.tiles.data_ptr() < 2 * huge_pages.HUGE_PAGE
    assert h.norm is small


def test_a_tensor_two_holders_share_is_copied_once_and_others_keep_working(on):
    t = torch.randn(200, 200)
    a, b = _Holder(panels=t), _Holder(panels=t)
    huge_pages.move_weights([a, b], ("panels",))
    assert torch.equal(a.panels, t) and torch.equal(b.panels, t)


def test_disabled_by_the_environment_moves_nothing(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "0")
    t = torch.randn(200, 200)
    h = _Holder(panels=t)
    assert huge_pages.move_weights([h], ("panels",)) == 0
    assert h.panels is t


def test_the_mapping_is_freed_with_its_tensors(on):
    h = _Holder(panels=torch.randn(256, 256))
    if huge_pages.move_weights([h], ("panels",)) == 0:
        pytest.skip("the kernel refused MADV_HUGEPAGE")
    base = h.panels
    while base._base is not None:
        base = base._base
    ref = weakref.ref(base)
    del h, base
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_output_is_the_same_with_and_without_huge_pages(tiny_llama_dir, monkeypatch, dtype):
    from kvserve import LLM, SamplingParams

    prompts = [[5, 6, 7, 8, 9], [17, 4, 17, 4], [40] * 12]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)  # the tiny model's weights are small
    moved = []
    real = huge_pages.move_weights
    monkeypatch.setattr(huge_pages, "move_weights", lambda *a: moved.append(real(*a)) or moved[-1])
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(huge_pages.ENV, flag)
        llm = LLM(model=str(tiny_llama_dir), dtype=str(dtype).split(".")[1], num_gpu_blocks=64)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        outs[flag] = [o.outputs[0].token_ids for o in res]
        del llm
    assert outs["0"] == outs["1"]
    assert all(len(t) == 12 for t in outs["1"])
    assert moved[0] == 0  # off
    if moved[-1] == 0:
        pytest.skip("no huge pages here: both runs used 4 KiB pages")


def test_each_original_is_released_before_the_next_tensor_moves(on):
    """The move's peak is the arena plus one tensor: a tensor's original is freed once copied,
    before the next holder is pointed at its copy (a 1B float32 model would otherwise hold its
    weights twice over while loading)."""
    first = torch.randn(200, 200)
    first_ref = weakref.ref(first)
    alive_when_second_moved = []

    class Recording(_Holder):
        def __setattr__(self, name, value):
            if self.__dict__.get("is_second"):
                alive_when_second_moved.append(first_ref() is not None)
            super().__setattr__(name, value)

    h1 = Recording(panels=first)
    h2 = Recording(panels=torch.randn(200, 200))
    h2.is_second = True
    alive_when_second_moved.clear()
    del first
    if huge_pages.move_weights([h1, h2], ("panels",)) == 0:
        pytest.skip("the kernel refused MADV_HUGEPAGE")
    assert alive_when_second_moved == [False]
