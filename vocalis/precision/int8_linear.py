"""Int8 linear layers for the LLM on CPU: our own int8 GEMV kernel (kernels/csrc/int8_gemv*.cpp), built on first use.

Why: decoding reads every weight once per step for a few rows, so its speed is the rate weights stream from
memory. fbgemm's dynamic int8 linear (`quantize_dynamic`) reads weights at one row well below the machine's copy
bandwidth, and the other torch int8 paths are no better. The kernel streams each panel of 64 output channels as one
contiguous run and does u8 x s8 -> s32 dot products (VPDPBUSD), 4 k-values x 16 channels per instruction, so it
reads weights at the memory bandwidth left to it; the gain over fbgemm is largest at batch 1 and shrinks as the
batch grows (docs/benchmarks.md).

On AVX2 CPUs (no VNNI, no AVX-512) the kernel is int8_gemv_avx2.cpp: the same math, both operands widened to
int16 and multiplied by VPMADDWD (exact int32 sums; VPMADDUBSW's int16 pair sums would saturate), the weights in
a panel order of their own (`Int8Weight.layout`, chosen by `kernels.build.isa()`). Its results equal the VNNI
kernel's (the same int32 sums) to fp32 rounding of the scale-out.

Math (what `int8_linear_reference` computes in float64): weights symmetric int8 per output channel
(sw = amax/127); each input row symmetric int8 (sx = amax/127, round half to even), sent to the VNNI kernel offset
to u8; int32 accumulation; y = acc * sx * sw + bias. Finer than fbgemm's per-tensor weight scale.

The extension is compiled by `torch.utils.cpp_extension.load_inline` (gcc + ninja) into torch's extension
cache dir, once per machine (`kernels.build`); it also holds the fused decode steps (kernels/csrc/int8_decode.cpp).
When the int8 kernel cannot be used (a CPU with neither AVX2 nor AVX-512 VNNI, AVX-512 without VNNI,
turned off by the caller: `KernelConfig.int8_kernel`, VOCALIS_INT8_KERNEL=0; no compiler, a build error),
`available()` is False, one log line says why, and the int8 backend keeps torch's dynamic quantization. The fp32 fused
step needs only the extension: `fp32_unavailable_reason()`.

Legend: M rows, K in features, N out features, P = ceil(N / 64) panels, K4 = ceil(K / 4).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from types import ModuleType

import torch
from torch import nn

from vocalis.kernels import bf16_attention, bf16_gemm, build, cpu
from vocalis.kernels.config import INT8_GRAIN_BYTES
from vocalis.precision.module_swap import swap_modules

log = logging.getLogger(__name__)

PANEL = 64  # output channels per panel; fused parts must be whole panels
_NO_BIAS = torch.empty(0)  # the kernel's "no bias" (its binding takes tensors only)
_logged = False  # whether the int8 kernel's own reason (no VNNI, switched off) was logged


def extension() -> ModuleType | None:
    """The native extension (`kernels.build.extension`)."""
    return build.extension()


def unavailable_reason(enabled: bool = True) -> str | None:
    """Why the int8 kernel (and with it the int8 fused decode step) cannot run here (None: it can); enabled=False
    (the caller's `KernelConfig.int8_kernel`) says it is turned off."""
    global _logged
    if not enabled:
        reason: str | None = "turned off (KernelConfig.int8_kernel, VOCALIS_INT8_KERNEL=0)"
    elif build.extension() is None:
        return build.unavailable_reason()  # logged by the build
    elif build.isa() == "avx512" and not cpu.features().at_least("avx512_vnni"):
        reason = f"the AVX-512 int8 kernel needs VNNI (CPU level {cpu.features().describe()})"
    else:
        reason = None
    if reason is not None and not _logged:
        _logged = True
        log.info("int8 kernel unavailable: %s; int8 linears use torch dynamic quantization", reason)
    return reason


def available(enabled: bool = True) -> bool:
    """Whether the int8 kernel (and with it the int8 fused decode step) can run here, and is not turned off."""
    return unavailable_reason(enabled) is None


def fp32_unavailable_reason() -> str | None:
    """Why the fp32 fused decode step cannot run here (None: it can): only the extension itself is needed."""
    return build.unavailable_reason()


def reset() -> None:
    """Forget every decision (tests that force a CPU level)."""
    global _logged
    _logged = False
    cpu.reset()
    build.reset()
    bf16_gemm.reset()
    bf16_attention.reset()


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A Linear's weight packed for the kernel (see kernels/csrc/int8_gemv*.cpp for the layouts)."""

    w: torch.Tensor  # (P, K4, 64, 4) int8, each group of 4 k x 64 channels in `layout`'s order
    scale: torch.Tensor  # (P*64,) fp32 per output channel (0-padded)
    corr: torch.Tensor  # (P*64,) int32: 128 * sum_k w, the u8 offset's contribution
    bias: torch.Tensor | None  # (P*64,) fp32 (0-padded)
    n: int  # real output channels N
    k: int  # input features K
    layout: str = "avx512"  # the kernel it is packed for: "avx512" (VNNI, int8_gemv.cpp) or "avx2"
    grain_bytes: int = INT8_GRAIN_BYTES  # weight bytes each thread gets at least when the kernel splits the GEMV


def layout() -> str:
    """The panel order of the kernel this CPU level runs (`kernels.build.isa()`; "avx512" where none runs)."""
    return "avx2" if build.isa() == "avx2" else "avx512"


def quantize_weight(weight: torch.Tensor, bias: torch.Tensor | None = None, order: str | None = None,
                    grain_bytes: int = INT8_GRAIN_BYTES) -> Int8Weight:
    """(N, K) float weight [+ (N,) bias] -> packed per-channel symmetric int8, in `order` (default: `layout()`)."""
    order = layout() if order is None else order
    n, k = weight.shape
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # (N,)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # (N, K)
    p, k4 = -(-n // PANEL), -(-k // 4)
    padded = torch.zeros(p * PANEL, k4 * 4, dtype=torch.int8)
    padded[:n, :k] = q
    if order == "avx2":  # [p, cb, c, g, h, t] -> [p, g, cb, h, c, t]: 32 bytes = 8 channels x (2 k, 2 k)
        packed = padded.view(p, 8, 8, k4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(p, k4, PANEL, 4).contiguous()
    else:  # [p, lane4, j, g, t] -> [p, g, lane4, j, t]: each panel contiguous, each 64 bytes = 16 channels x 4 k
        packed = padded.view(p, 4, 16, k4, 4).permute(0, 3, 1, 2, 4).reshape(p, k4, PANEL, 4).contiguous()
    corr = 128 * padded.sum(dim=1, dtype=torch.int32)

    def pad(v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(p * PANEL, dtype=torch.float32)
        out[:n] = v.detach().float()
        return out

    return Int8Weight(packed, pad(scale), corr.to(torch.int32), None if bias is None else pad(bias), n, k,
                      layout=order, grain_bytes=grain_bytes)


def int8_linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """x (M, K) fp32 -> (M, N) fp32 through the kernel (`extension()` must be available)."""
    ext = extension()
    assert ext is not None, "int8 kernel unavailable"
    assert ext.isa == w.layout, f"weight packed for the {w.layout} kernel, this one is {ext.isa}"
    return ext.int8_linear(x, w.w, w.scale, w.corr, _NO_BIAS if w.bias is None else w.bias, w.n, w.grain_bytes)


def int8_linear_reference(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """The kernel's math in float64 torch ops (for tests): same activation rounding, exact accumulation."""
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.ones_like(amax))  # fp32, as the kernel
    sx = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    xq = torch.round(x * inv).double()  # (M, K)
    y = (xq @ _unpack(w).double().t()) * (sx.double() * w.scale[:w.n].double())
    return (y + w.bias[:w.n].double() if w.bias is not None else y).float()


def _unpack(w: Int8Weight) -> torch.Tensor:
    """The int8 values in (N, K) row-major order (the inverse of the panel packing)."""
    p, k4 = w.w.shape[:2]
    if w.layout == "avx2":
        return w.w.view(p, k4, 8, 2, 8, 2).permute(0, 2, 4, 1, 3, 5).reshape(p * PANEL, k4 * 4)[:w.n, :w.k]
    return w.w.view(p, k4, 4, 16, 4).permute(0, 2, 3, 1, 4).reshape(p * PANEL, k4 * 4)[:w.n, :w.k]


def fuse(weights: list[Int8Weight]) -> tuple[Int8Weight, list[Int8Weight]] | None:
    """Concatenate packed weights along N (one kernel call for q, k, v or gate, up); also returns each part
    as a view into the fused storage. None when a part other than the last is not whole panels, or K or the layout
    differs."""
    if any(w.n % PANEL for w in weights[:-1]) or len({w.k for w in weights}) != 1 or len({w.layout for w in weights}) != 1:
        return None
    biased = any(w.bias is not None for w in weights)
    fused = Int8Weight(
        torch.cat([w.w for w in weights]), torch.cat([w.scale for w in weights]),
        torch.cat([w.corr for w in weights]),
        torch.cat([w.bias if w.bias is not None else torch.zeros_like(w.scale) for w in weights]) if biased
        else None,
        sum(w.n for w in weights), weights[0].k, layout=weights[0].layout, grain_bytes=weights[0].grain_bytes)
    views, start = [], 0
    for w in weights:
        p = w.w.shape[0]
        c = slice(start * PANEL, (start + p) * PANEL)
        views.append(replace(w, w=fused.w[start:start + p], scale=fused.scale[c], corr=fused.corr[c],
                             bias=None if fused.bias is None else fused.bias[c]))
        start += p
    return fused, views


class Int8Linear(nn.Module):
    """`nn.Linear` with its weight packed for the int8 kernel; any leading dims, fp32 in and out."""

    def __init__(self, linear: nn.Linear, grain_bytes: int = INT8_GRAIN_BYTES) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = quantize_weight(linear.weight, linear.bias, grain_bytes=grain_bytes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_linear(x.reshape(-1, self.in_features).float(), self.packed)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel "
                f"({self.packed.layout} kernel)")


def int8_linears(module: nn.Module, grain_bytes: int = INT8_GRAIN_BYTES) -> int:
    """Replace every fp32 `nn.Linear` below `module` by an `Int8Linear` (in place); returns how many."""
    return swap_modules(module, lambda m: type(m) is nn.Linear, lambda m: Int8Linear(m, grain_bytes))
