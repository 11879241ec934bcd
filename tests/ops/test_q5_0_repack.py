"""``quant_pack.q8_0_from_q5_0``: GGUF Q5_0 blocks repacked as Q8_0 dequantize bit for bit to
what the ``gguf`` package's reference dequantizer gives for the Q5_0 bytes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from kvserve.ops import quant
from kvserve.ops.quant_pack import Q5_0_BLOCK_BYTES, Q8_0_BLOCK_BYTES, q8_0_from_q5_0

T = gguf.GGMLQuantizationType


def random_q5_0(rng, rows: int, blocks: int) -> np.ndarray:
    """Random Q5_0 rows: every code bit random, finite float16 scales of both signs, small to
    large (subnormal included)."""
    b = rng.integers(0, 256, (rows, blocks, Q5_0_BLOCK_BYTES), dtype=np.uint8)
    d = (rng.standard_normal((rows, blocks)) * 10.0 ** rng.integers(-6, 4, (rows, blocks))).astype(np.float16)
    b[..., :2] = d.view(np.uint8).reshape(rows, blocks, 2)
    return b.reshape(rows, blocks * Q5_0_BLOCK_BYTES)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(
        np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32)
    )


@pytest.mark.parametrize("shape", [(1, 1), (3, 2), (17, 20), (64, 5)])
def test_repacked_random_blocks_dequantize_bit_identically(shape):
    rng = np.random.default_rng(shape[0] * 100 + shape[1])
    q5 = random_q5_0(rng, *shape)
    q8 = q8_0_from_q5_0(q5)
    assert q8.dtype == np.uint8 and q8.shape == (shape[0], shape[1] * Q8_0_BLOCK_BYTES)
    assert q8.flags.c_contiguous
    assert same_bits(dequantize(q8, T.Q8_0), dequantize(q5, T.Q5_0))
    # codes lie in [-16, 15]; the scale bytes are carried over as they are
    blocks = q8.reshape(-1, Q8_0_BLOCK_BYTES)
    codes = blocks[:, 2:].view(np.int8)
    assert codes.min() >= -16 and codes.max() <= 15
    assert np.array_equal(blocks[:, :2], q5.reshape(-1, Q5_0_BLOCK_BYTES)[:, :2])
    # and the kernels' own dequantizer reads the same values
    got = quant.dequantize_blocks(torch.from_numpy(q8), "q8_0").reshape(shape[0], -1)
    assert same_bits(got.numpy(), dequantize(q5, T.Q5_0))


@pytest.mark.parametrize("code", [0, 15, 16, 31])
def test_extreme_and_middle_codes(code):
    """Every weight of a block on one code: ``qh`` all ones or zeros, nibbles 0x0 / 0xF."""
    b = np.zeros((2, Q5_0_BLOCK_BYTES), dtype=np.uint8)
    b[:, :2] = np.array([0.5, -3.0], dtype=np.float16).view(np.uint8).reshape(2, 2)
    b[:, 2:6] = 0xFF if code & 16 else 0
    b[:, 6:] = (code & 15) * 0x11
    want = np.array([[0.5 * (code - 16)] * 32, [-3.0 * (code - 16)] * 32], dtype=np.float32)
    assert same_bits(dequantize(b, T.Q5_0), want)
    assert same_bits(dequantize(q8_0_from_q5_0(b), T.Q8_0), want)


def test_high_bit_of_each_position_lands_on_its_own_weight():
    """One high bit at a time (bit i of ``qh`` is code i's bit 4), so a swapped bit order or
    nibble half would show."""
    b = np.zeros((32, Q5_0_BLOCK_BYTES), dtype=np.uint8)
    b[:, :2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    qh = (np.uint32(1) << np.arange(32, dtype=np.uint32)).astype("<u4")
    b[:, 2:6] = qh.view(np.uint8).reshape(32, 4)
    b[:, 6:] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
    got = dequantize(q8_0_from_q5_0(b), T.Q8_0)
    assert same_bits(got, dequantize(b, T.Q5_0))
    low = np.concatenate([np.arange(16), np.arange(16)[::-1]]).astype(np.float32)
    want = np.tile(low - 16, (32, 1)) + 16 * np.eye(32, dtype=np.float32)
    assert same_bits(got, want)


def test_quantized_float_weights_round_trip():
    """Blocks from the ``gguf`` package's own Q5_0 quantizer (the writer's path)."""
    w = np.random.default_rng(3).standard_normal((12, 160)).astype(np.float32)
    q5 = quantize(w, T.Q5_0)
    assert same_bits(dequantize(q8_0_from_q5_0(q5), T.Q8_0), dequantize(q5, T.Q5_0))


@pytest.mark.parametrize(
    "bad", [np.zeros((2, 23), np.uint8), np.zeros((2, 22), np.int8), np.zeros((), np.uint8)]
)
def test_rows_that_are_not_whole_uint8_blocks_are_refused(bad):
    with pytest.raises(ValueError, match="whole 22-byte blocks"):
        q8_0_from_q5_0(bad)
