"""A conv's GEMM input built natively from its left context and new frames (`conv_gemm.columns_after`,
conv_columns.cpp) equals torch's concatenation and shifted copies bit for bit, at this CPU's level and at the
AVX2 level (the other source set where the CPU has more): fp32 and bf16, frames stored channel-major, time-major or
as strided slices, with and without context; and `Int8Conv1d.after` equals the conv of the joined input."""

from __future__ import annotations

import pytest
import torch

from vocalis.precision.conv_gemm import columns, columns_after
from vocalis.precision.dynamic_int8 import Int8Conv1d

pytestmark = pytest.mark.usefixtures("native_level")


def _frames(layout: str, B: int, C: int, n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if layout == "channel-major":
        return torch.randn(B, C, n, generator=g).to(dtype)
    if layout == "time-major":
        return torch.randn(B, n, C, generator=g).to(dtype).transpose(1, 2)
    return torch.randn(B, C + 3, n + 5, generator=g).to(dtype)[:, 2 : C + 2, 4 : n + 4]  # strided slices


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["channel-major", "time-major", "sliced"])
@pytest.mark.parametrize(("k", "ctx", "n"), [(3, 2, 100), (3, 2, 1), (1, 0, 7), (3, 0, 5), (2, 1, 9)])
def test_columns_after_equals_torch(k: int, ctx: int, n: int, layout: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(k * 100 + n)
    B, C = 4, 24
    x = _frames(layout, B, C, n, dtype, g)
    left = torch.randn(B, C, ctx, generator=g).to(dtype)
    got = columns_after(left, x, k)
    want = columns(torch.cat([left, x], dim=2), k)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got, want)


def test_int8_conv_after_its_context_equals_the_joined_conv() -> None:
    g = torch.Generator().manual_seed(0)
    conv = Int8Conv1d(torch.nn.Conv1d(16, 8, 3))
    left, x = torch.randn(2, 16, 2, generator=g), torch.randn(2, 100, 16, generator=g).transpose(1, 2)
    with torch.no_grad():
        assert torch.equal(conv.after(left, x), conv.valid(torch.cat([left, x], dim=2)))
