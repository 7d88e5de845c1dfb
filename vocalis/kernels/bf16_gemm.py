"""bf16 GEMMs for the token2wav estimator on AMX CPUs: oneDNN's tile kernel called from our own loop
(bf16_gemm.cpp), with the bias, GELU and residual add fused into the write of the result.

Why: the estimator's layers are small (a first chunk is 200 rows: two guidance rows x 100 frames; K and N
256-1536) and each transformer block alternates four GEMM shapes. torch's prepacked oneDNN GEMM spends about
as long per call outside its kernel as in it there; our loop calls the tile kernel directly. The fused epilogues
save the separate GELU, cast and residual-add ops.

Math: x bf16, W bf16, fp32 accumulation over the whole K, + bias in fp32 (torch's path adds a bf16 bias), then
bf16 rounding (RNE) or an fp32 add into the residual stream (no bf16 rounding of the layer's output at all).
GELU is the exact erf form with erf to ~2e-7.

The kernel lives in the native extension (`build.extension()`, compiled once per machine); `available()`
says whether it runs here (the extension builds and the CPU has AMX tiles, where the tile kernel is the fast one).
Whether to use it where it runs is the caller's choice (`kernels.config.KernelConfig.bf16_gemm`,
VOCALIS_BF16_GEMM=0: torch's oneDNN GEMM instead).
Legend: M rows, K in features, N out features.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from vocalis.kernels import build
from vocalis.kernels.cpu import has_amx

log = logging.getLogger(__name__)

_EPILOGUE_BF16, _EPILOGUE_GELU_BF16, _EPILOGUE_ADD_F32 = 0, 1, 2
_NO_BIAS = torch.empty(0)
_NO_RESIDUAL = torch.empty(0)
_NO_LIMITS = torch.empty(0, dtype=torch.int32)
_available: bool | None = None


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A layer's weight in the kernel's layout: panels (ceil(N / 64), K / 2, 64, 2) bf16, and its fp32 bias."""

    panels: torch.Tensor
    n: int  # true output features
    bias: torch.Tensor  # (N,) fp32, or empty


def available() -> bool:
    """Whether the bf16 tile kernel runs here (decided once): AMX CPU, the native extension built, and a small
    GEMM through it agrees with torch's (else logged, and the caller keeps torch's ops)."""
    global _available
    if _available is None:
        ext = build.extension() if has_amx() else None
        if ext is None and has_amx() and not build.settled():
            return False  # compiling in the background: asked again once it is ready
        _available = ext is not None and bool(ext.bf16_usable())
        if _available and not _agrees():
            log.warning("native bf16 GEMM disagrees with torch's on a small check; using torch's ops")
            _available = False
    return _available


def reset() -> None:
    """Forget the decision (tests that force a CPU level)."""
    global _available
    _available = None


def _agrees() -> bool:
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 32, generator=g), torch.randn(70, 32, generator=g), torch.randn(70, generator=g)
    try:
        y = linear(x, pack(w, b)).float()
    except RuntimeError:
        return False
    ref = torch.nn.functional.linear(x.bfloat16().float(), w.bfloat16().float(), b)
    return bool(torch.allclose(y, ref, rtol=2e-2, atol=2e-2))


def serves(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel runs compute of `dtype` on `device`: bf16 on the CPU, where `available()`."""
    return dtype == torch.bfloat16 and device.type == "cpu" and available()


def supports(weight: torch.Tensor) -> bool:
    """Whether a weight (N, K) can go through the kernel: a CPU tensor with even K (the layout pairs k values)."""
    return weight.device.type == "cpu" and weight.dim() == 2 and weight.shape[1] % 2 == 0


def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedWeight:
    """weight (N, K) any float dtype, bias (N,) or None -> the packed layer (weight rounded to bf16 once)."""
    ext = build.extension()
    assert ext is not None and supports(weight)
    panels = ext.bf16_pack(weight.detach().to(torch.bfloat16).contiguous())
    b = _NO_BIAS if bias is None else bias.detach().float().contiguous()
    return PackedWeight(panels, weight.shape[0], b)


def linear(x: torch.Tensor, w: PackedWeight, gelu: bool = False) -> torch.Tensor:
    """x (M, K) -> (M, N) bf16: x @ W^T + bias, GELU'd when `gelu`."""
    ext = build.extension()
    return ext.bf16_linear(_rows(x), w.panels, w.n, w.bias, _EPILOGUE_GELU_BF16 if gelu else _EPILOGUE_BF16,
                           _NO_RESIDUAL)


def linear_add_(residual: torch.Tensor, x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """residual (M, N) fp32 contiguous += x (M, K) @ W^T + bias, in place; returns residual."""
    ext = build.extension()
    return ext.bf16_linear(_rows(x), w.panels, w.n, w.bias, _EPILOGUE_ADD_F32, residual)


@dataclass(frozen=True)
class BlockWeights:
    """What the one-call transformer block (bf16_block.cpp) reads: the two norms (fp32 weights, biases, eps), the
    head layout, and the packed q/k/v (no bias), output projection and feed-forward GEMMs."""

    norm1: nn.LayerNorm
    norm3: nn.LayerNorm
    heads: int
    head_dim: int
    qkv: PackedWeight
    out: PackedWeight
    ff1: PackedWeight
    ff2: PackedWeight


def transformer_block(x: torch.Tensor, w: BlockWeights, cached_k: list[torch.Tensor], cached_v: list[torch.Tensor],
                      limits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, n, D) fp32 contiguous += attention(norm1(x)), then += feed-forward(norm3(x)), in place (bf16_block.cpp).
    The new frames attend over cached_k/cached_v (pieces (B or a divisor of B, H, L_i, E) bf16, in order) and
    their own keys, each frame the keys [0, limit) (limits (1 or B, n) int32; None: all) -> the new frames' keys
    and values, (B, H, n, E) bf16 each."""
    ext = build.extension()
    n1, n3 = w.norm1, w.norm3
    return ext.bf16_block(x, n1.weight, n1.bias, n1.eps, w.qkv.panels, w.heads, w.head_dim, w.out.panels,
                          w.out.bias, n3.weight, n3.bias, n3.eps, w.ff1.panels, w.ff1.bias, w.ff1.n,
                          w.ff2.panels, w.ff2.bias, cached_k, cached_v, _NO_LIMITS if limits is None else limits)


def conv(x: torch.Tensor, left: torch.Tensor, w: PackedWeight, taps: int) -> torch.Tensor:
    """Causal conv of `taps` taps (weight packed from (C_out, taps * C_in), tap-major): x (B, C_in, n) fp32 and
    the taps - 1 frames before it, left (B, C_in, taps - 1) fp32 -> (B, C_out, n) fp32 (+ bias), a transposed
    view of a time-major result. x is read time-major; a channels-first x is transposed once first."""
    ext = build.extension()
    if x.stride(1) != 1:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    return ext.bf16_conv(x, left, w.panels, w.n, w.bias, taps).transpose(1, 2)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).contiguous()
