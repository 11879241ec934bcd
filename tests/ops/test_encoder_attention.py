"""The native encoder (bidirectional, packed variable-length) attention against a float64
torch reference: sequence lengths around the 16-row tiles and 4-key steps, head sizes, both
dtypes, padding rows past the last sequence, strided rows, and its argument checks."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from kvserve.ops import encoder_attention as ea

pytestmark = pytest.mark.skipif(
    not ea.available(), reason=f"native kernel unavailable: {ea.failure_reason()}"
)

# float32: sums in another order (~1e-6 relative); bfloat16: float32 sums of exact inputs, so
# the extra error is the output's rounding, half an ulp (at most 2**-8 of the value).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-5}
RELATIVE = {torch.float32: 1e-5, torch.bfloat16: 2**-8}


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    err = (got.double() - want).abs()
    return bool((err <= TOLERANCE[got.dtype] + RELATIVE[got.dtype] * want.abs()).all())


def reference(qkv: torch.Tensor, lens: list[int], nh: int, hd: int, scale: float) -> torch.Tensor:
    H = nh * hd
    out, start = [], 0
    for n in lens:
        x = qkv[start : start + n].double().view(n, 3, nh, hd).permute(1, 2, 0, 3)
        o = F.scaled_dot_product_attention(x[0], x[1], x[2], scale=scale)  # [nh, n, hd]
        out.append(o.transpose(0, 1).reshape(n, H))
        start += n
    return torch.cat(out)


def cu_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nh,hd", [(12, 32), (4, 64), (2, 8), (1, 256)])
def test_matches_float64_reference(dtype, nh, hd):
    torch.manual_seed(nh * hd)
    lens = [1, 2, 3, 4, 5, 15, 16, 17, 31, 33, 80, 129]
    H = nh * hd
    qkv = (torch.randn(sum(lens), 3 * H) * 2).to(dtype)
    scale = hd**-0.5
    got = ea.encoder_attention(qkv, cu_of(lens), nh, hd, scale)
    assert got.dtype == dtype and got.shape == (sum(lens), H)
    want = reference(qkv, lens, nh, hd, scale)
    assert close(got, want)


def test_each_sequence_attends_only_its_own_rows():
    """Changing one sequence's keys/values leaves every other sequence's output bit-identical."""
    torch.manual_seed(1)
    lens, nh, hd = [7, 20, 3], 2, 16
    qkv = torch.randn(sum(lens), 6 * hd * nh // 2)
    base = ea.encoder_attention(qkv, cu_of(lens), nh, hd, 0.25)
    qkv[7:27, nh * hd :] += 5.0  # the second sequence's k and v
    moved = ea.encoder_attention(qkv, cu_of(lens), nh, hd, 0.25)
    assert torch.equal(base[:7], moved[:7]) and torch.equal(base[27:], moved[27:])
    assert not torch.equal(base[7:27], moved[7:27])


def test_padding_rows_are_zero_and_strided_rows_are_read_in_place():
    torch.manual_seed(2)
    lens, nh, hd = [5, 18], 3, 32
    H = nh * hd
    wide = torch.randn(sum(lens) + 9, 3 * H + 16)  # 9 padding rows; rows 16 elements apart more
    qkv = wide[:, : 3 * H]
    got = ea.encoder_attention(qkv, cu_of(lens), nh, hd, hd**-0.5)
    assert got.shape == (sum(lens) + 9, H)
    assert torch.equal(got[sum(lens) :], torch.zeros(9, H))
    want = reference(qkv[: sum(lens)].contiguous(), lens, nh, hd, hd**-0.5)
    assert close(got[: sum(lens)], want)


def test_empty_step_and_empty_sequences():
    qkv = torch.randn(4, 3 * 16)
    assert ea.encoder_attention(qkv, cu_of([]), 1, 16, 1.0).abs().sum() == 0
    got = ea.encoder_attention(qkv, cu_of([0, 4, 0]), 1, 16, 0.25)
    want = reference(qkv, [4], 1, 16, 0.25)
    assert close(got, want)


@pytest.mark.parametrize(
    "qkv,cu,nh,hd,match",
    [
        (torch.randn(4, 48), torch.tensor([0, 5]), 1, 16, "cu_seqlens"),
        (torch.randn(4, 48), torch.tensor([0, 3, 2]), 1, 16, "cu_seqlens"),
        (torch.randn(4, 48), torch.tensor([1, 4]), 1, 16, "cu_seqlens"),
        (torch.randn(4, 48), torch.tensor([0, 4], dtype=torch.int32), 1, 16, "cu_seqlens"),
        (torch.randn(4, 40), torch.tensor([0, 4]), 1, 16, r"\[T, 3 \* 16\]"),
        (torch.randn(4, 36), torch.tensor([0, 4]), 1, 12, "head_dim 12"),
        (torch.randn(4, 48).half(), torch.tensor([0, 4]), 1, 16, "dtype"),
    ],
)
def test_bad_arguments_are_refused(qkv, cu, nh, hd, match):
    with pytest.raises(ValueError, match=match):
        ea.encoder_attention(qkv, cu, nh, hd, 1.0)
