"""Dynamic int8 Linear layers for the flow estimator on CPU (`Int8Linear`: one fbgemm int8 GEMM each), and its
conv blocks' convs as one such GEMM over their shifted inputs (`Int8Conv1d`).

Weights are quantized once, symmetric int8 per output channel; activations are quantized per call (one scale and
zero point over the whole input, asymmetric uint8), products summed exactly in int32 and scaled back to fp32.

Why not `torch.ao.quantization.quantize_dynamic`'s modules: they always ask fbgemm for 7-bit activations
(`reduce_range`). That is one exact way to run on CPUs without VNNI, whose u8 x s8 pair products are summed into
saturating int16 (255 x 127 x 2 > 32767); VPDPBUSD sums into int32 and needs neither. The other exact way keeps
8-bit activations and quantizes the weights to 7 bits (|w| <= 63: 255 x 63 x 2 fits int16), which is what this
module does there (`weight_bits`): the activations' one per-tensor scale is the coarser of the two, so their bit
matters more than the per-channel weights' (both at 8 bits would saturate). With VNNI, 8 bits for both, which
roughly halves `quantize_dynamic`'s error at the same speed. tests/test_backends.py checks for saturation on the
input that would cause it.

Legend: K / N input / output width.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from vocalis.kernels import cpu
from vocalis.kernels.heap import MMAP_THRESHOLD_BYTES
from vocalis.models.flow.estimator import CausalBlock1D, CausalConv1d
from vocalis.precision.conv_gemm import columns, columns_after, gemm_weight
from vocalis.precision.module_swap import swap_modules


def weight_bits() -> int:
    """Bits of the int8 weights here: 8 with VNNI's int32 sums, else 7 so that fbgemm's int16 pair sums of 8-bit
    activations cannot saturate (module doc)."""
    return 8 if cpu.features().at_least("avx512_vnni") else 7


def use_x86_quantized_engine() -> None:
    """Quantized ops through fbgemm's x86 kernels (fastest here at batch 1 and at flow-sized batches)."""
    if "x86" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "x86"


class Int8Linear(nn.Module):
    """`nn.Linear` as a dynamically quantized int8 GEMM (module doc): x (..., K) fp32 -> (..., N) fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """weight (N, K) fp32, bias (N,) or None."""
        super().__init__()
        use_x86_quantized_engine()
        w = weight.detach().float().contiguous()
        self.weight_bits = weight_bits()
        qmax = 2 ** (self.weight_bits - 1) - 1
        scale = (w.abs().amax(dim=1) / qmax).clamp_min(1e-12).double()
        with warnings.catch_warnings():  # quantized tensors are deprecated upstream but present in torch 2.13
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        self.out_features, self.in_features = w.shape
        self._packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(linear.weight, linear.bias)

    @classmethod
    def concat(cls, parts: list[Int8Linear]) -> Int8Linear:
        """One layer computing `parts` side by side (their outputs concatenated along N), from their quantized
        weights as they are: per-channel weights and the one per-call activation scale are unchanged, so its
        outputs equal the parts' bit for bit. Parts share K."""
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("Int8Linear.concat: the parts' input widths differ")
        unpacked = [torch.ops.quantized.linear_unpack(p._packed) for p in parts]  # (qweight (N, K), bias) each
        ints = torch.cat([q.int_repr() for q, _ in unpacked])
        scales = torch.cat([q.q_per_channel_scales() for q, _ in unpacked])
        biases = [b for _, b in unpacked]
        bias = None if all(b is None for b in biases) else torch.cat(
            [torch.zeros(p.out_features) if b is None else b for p, b in zip(parts, biases)])
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.weight_bits = parts[0].weight_bits
        fused.out_features, fused.in_features = ints.shape
        qweight = torch._make_per_channel_quantized_tensor(ints, scales, torch.zeros_like(scales, dtype=torch.long),
                                                           0)
        fused._packed = torch.ops.quantized.linear_prepack(qweight, bias)
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reduce_range False: 8-bit activations, exact with either weight width (module doc)
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, self.in_features), self._packed, False)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.weight_bits}-bit weights, "
                "8-bit activations")


class FusedQKV:
    """Each attention's q/k/v `Int8Linear`s as one GEMM (`Int8Linear.concat`, made on first use and kept for the
    owner's life): the input is quantized once and one wider GEMM runs instead of three, with outputs equal to the
    three layers' bit for bit, and faster. Rows whose fused output would reach `heap.MMAP_THRESHOLD_BYTES` run the
    three layers instead (the same values): a block that large is mapped fresh and faulted in on every call where
    the engine caps glibc's threshold (`kernels.heap`), which costs more than the fusion saves."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[nn.Module, Int8Linear | None]] = {}

    def project(self, attn: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """x (M, D) -> (M, 3 * H * E): q, k, v side by side; None where `attn`'s projections are not all
        `Int8Linear` or the output would be large (the caller runs its layers)."""
        hit = self._cache.get(id(attn))
        if hit is None or hit[0] is not attn:
            parts = [attn.to_q, attn.to_k, attn.to_v]
            fused = Int8Linear.concat(parts) if all(type(p) is Int8Linear for p in parts) else None
            hit = self._cache[id(attn)] = (attn, fused)
        fused = hit[1]
        if fused is None or x.shape[0] * fused.out_features * 4 >= MMAP_THRESHOLD_BYTES:
            return None
        return fused(x)


class Int8Conv1d(nn.Module):
    """A stride-1 `nn.Conv1d` (or `CausalConv1d`: `causal_padding` zeros on the left) as one `Int8Linear` over its
    k shifted inputs side by side (im2col): x (B, C_in, T) -> (B, C_out, T - k + 1 + causal_padding) fp32, returned
    as a transposed view of a time-major result (the LayerNorm after a block's conv reads it as is).

    The weight is laid out as `conv_gemm` says and quantized per output channel as `Int8Linear` does; the
    activations take one scale per call over the whole input, so the error grows with the input's largest channel
    (the estimator's unnormalised residual stream)."""

    def __init__(self, conv: nn.Conv1d) -> None:
        super().__init__()
        if conv.stride != (1,) or conv.dilation != (1,) or conv.groups != 1 or conv.padding not in ((0,), "valid"):
            raise ValueError("Int8Conv1d takes stride-1, undilated, ungrouped, unpadded convs")
        c_out, c_in, k = conv.weight.shape
        self.in_channels, self.out_channels, self.kernel_size = c_in, c_out, (k,)
        self.causal_padding = getattr(conv, "causal_padding", 0)
        self.gemm = Int8Linear(gemm_weight(conv.weight.detach()), conv.bias)

    def valid(self, full: torch.Tensor) -> torch.Tensor:
        """The unpadded conv: full (B, C_in, k - 1 + n) -> (B, C_out, n)."""
        return self.gemm(columns(full, self.kernel_size[0])).transpose(1, 2)

    def after(self, left: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The unpadded conv of x (B, C_in, n) after its left context (B, C_in, k - 1) -> (B, C_out, n)."""
        return self.gemm(columns_after(left, x, self.kernel_size[0])).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.valid(F.pad(x, (self.causal_padding, 0)) if self.causal_padding else x)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, {self.gemm.extra_repr()}"


def weight_count(module: nn.Module) -> int:
    """Weights below `module` as its model has them: its parameters plus the weights its `Int8Linear`s hold packed
    (not parameters), so a quantized module counts as large as its fp32 original."""
    packed = sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, Int8Linear))
    return packed + sum(p.numel() for p in module.parameters())


def quantize_estimator_int8(estimator: nn.Module, convs: bool = False) -> int:
    """Replace (in place) every `nn.Linear` of the flow estimator by `Int8Linear`, and with `convs` the causal conv
    of every conv block (conv -> LayerNorm -> Mish) by `Int8Conv1d`; returns how many modules were replaced.

    As int8 GEMMs over their shifted inputs the convs run faster than oneDNN's fp32 convs. Only the blocks' convs: the
    LayerNorm after each rescales every frame, so the error of one activation scale per call mostly stays small
    there, while the resnets' residual convs and the down/up-sampling convs add straight into the unnormalised
    residual stream, whose few large channels one scale serves badly (docs/benchmarks.md)."""
    count = swap_modules(estimator, lambda m: type(m) is nn.Linear, Int8Linear.from_linear)
    if convs:
        for block in estimator.modules():
            if isinstance(block, CausalBlock1D) and type(block.block[0]) is CausalConv1d:
                block.block[0] = Int8Conv1d(block.block[0])
                count += 1
    return count
