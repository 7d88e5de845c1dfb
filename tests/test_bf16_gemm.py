"""Our bf16 GEMM (`vocalis.kernels.bf16_gemm`, AMX CPUs): each epilogue against float64 math on the same bf16
inputs, at shapes with row, column and panel tails.

Bounds: bf16 output (plain and GELU) within one bf16 rounding of the exact result: |err| <= 2^-8 |y| + 1e-6
[measured ~2^-9]; the fp32 residual add within fp32 summation error, 1e-5 of the output's range [~3e-7]."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vocalis.kernels import bf16_gemm

pytestmark = pytest.mark.skipif(not bf16_gemm.available(),
                                reason="our bf16 GEMM runs on AMX CPUs only (with the native extension built)")

SHAPES = [(200, 256, 1536), (200, 1024, 256), (7, 64, 80), (33, 320, 100), (1, 2, 1), (65, 768, 256)]


def _case(m: int, k: int, n: int, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    exact = x.bfloat16().double() @ w.bfloat16().double().T + (0 if b is None else b.double())
    return x, w, b, exact


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_epilogues_against_exact(m: int, k: int, n: int, bias: bool) -> None:
    x, w, b, exact = _case(m, k, n, bias, seed=m + k + n)
    packed = bf16_gemm.pack(w, b)
    y = bf16_gemm.linear(x, packed)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert ((y.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
    g = bf16_gemm.linear(x, packed, gelu=True)
    want = F.gelu(exact)
    assert ((g.double() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()
    residual = torch.randn(m, n, generator=torch.Generator().manual_seed(1))
    before = residual.clone()
    out = bf16_gemm.linear_add_(residual, x, packed)
    assert out is residual  # in place
    err = (residual.double() - before.double() - exact).abs().max().item()
    assert err <= 1e-5 * exact.abs().max().item()


def test_bf16_inputs_and_rows_independent() -> None:
    """bf16 input is taken as is (fp32 input is rounded to it first); a row's result does not depend on the other
    rows (each 32-row tile is computed alone, so a batch gives each request what it gets alone)."""
    x, w, b, _ = _case(70, 256, 192, True, seed=3)
    packed = bf16_gemm.pack(w, b)
    torch.testing.assert_close(bf16_gemm.linear(x, packed), bf16_gemm.linear(x.bfloat16(), packed), rtol=0, atol=0)
    whole = bf16_gemm.linear(x, packed)
    torch.testing.assert_close(whole[:32], bf16_gemm.linear(x[:32], packed), rtol=0, atol=0)


def test_odd_k_is_not_supported() -> None:
    """The layout pairs k values: an odd-K weight is reported unsupported (the caller keeps torch's GEMM)."""
    assert not bf16_gemm.supports(torch.randn(8, 3))
    assert bf16_gemm.supports(torch.randn(8, 4))


@pytest.mark.parametrize("taps", [1, 3])
@pytest.mark.parametrize("time_major", [True, False])
def test_causal_conv_against_exact(taps: int, time_major: bool) -> None:
    """`conv`: (left context, x) through a causal conv of `taps` taps, both layouts of x (the estimator's time-major
    views and a channels-first tensor), rows and channels with tails; fp32 out within bf16 input rounding of the
    exact result (inputs and weights rounded to bf16, fp32 sums: |err| <= 1e-5 of the range)."""
    g = torch.Generator().manual_seed(taps)
    b, c_in, c_out, n = 3, 40, 70, 37
    x = torch.randn(b, n, c_in, generator=g).transpose(1, 2) if time_major else torch.randn(b, c_in, n, generator=g)
    left = torch.randn(b, c_in, taps - 1, generator=g)
    w = torch.randn(c_out, c_in, taps, generator=g) / (c_in * taps) ** 0.5
    bias = torch.randn(c_out, generator=g)
    packed = bf16_gemm.pack(w.permute(0, 2, 1).reshape(c_out, taps * c_in), bias)  # tap-major, as the engine packs
    y = bf16_gemm.conv(x, left, packed, taps)
    full = torch.cat([left, x], dim=2).bfloat16().double()
    exact = F.conv1d(full, w.bfloat16().double(), bias.double())
    assert y.shape == (b, c_out, n) and y.dtype == torch.float32
    assert (y.double() - exact).abs().max().item() <= 1e-5 * exact.abs().max().item()
