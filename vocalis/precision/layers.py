"""Reduced-precision layers swapped in for `nn.Linear` / convs: bf16/fp16 weights (`CastLinear`, `CastConv`) and
torch's dynamic int8 quantization. Which model parts get them is the runtime's choice (`backends.choice`)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from vocalis.precision.dynamic_int8 import use_x86_quantized_engine
from vocalis.precision.module_swap import swap_modules


class CastLinear(nn.Module):
    """`nn.Linear` with weights stored in a reduced float dtype: input cast down, output cast back."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().to(dtype), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # 2-D input: the CPU bf16 GEMM has a fast path for 2-D and a slow one for batched 3-D shapes
        y = F.linear(x.reshape(-1, self.in_features).to(self.weight.dtype), self.weight, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


class CastConv(nn.Module):
    """`nn.Conv1d` / `nn.ConvTranspose1d` (weight norm folded) with weights in a given float dtype: input cast to
    it, output cast back.

    time_major: the weights are stored channels-last (C_out, C_in, 1, k) and the conv runs as a 2-D conv over a
    height-1 image, so oneDNN takes its channels-last kernels and returns the output time-major ((B, C, T) with
    channel stride 1); elementwise ops keep that layout, so the next such conv reads it as it lies. At HiFT's
    shapes (64-128 channels over thousands of samples) those kernels are faster on AVX2
    (`python benchmarks/bench_hift.py`); values equal the NCL conv's up to summation order."""

    def __init__(self, conv: nn.Conv1d | nn.ConvTranspose1d, dtype: torch.dtype, time_major: bool = False) -> None:
        super().__init__()
        self.transposed = isinstance(conv, nn.ConvTranspose1d)
        self.stride, self.padding, self.dilation, self.groups = conv.stride, conv.padding, conv.dilation, conv.groups
        self.output_padding = conv.output_padding
        self.time_major = time_major
        # `conv.weight` is the parametrized (weight-normed) weight where there is one: computed once here
        weight = conv.weight.detach().to(dtype)
        if time_major:
            weight = weight.unsqueeze(2).contiguous(memory_format=torch.channels_last)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.weight.dtype)
        if self.time_major:  # (B, C, 1, T): height 1 with no padding, stride or dilation
            h = h.unsqueeze(2)
            if self.transposed:
                y = F.conv_transpose2d(h, self.weight, self.bias, (1, *self.stride), (0, *self.padding),
                                       (0, *self.output_padding), self.groups, (1, *self.dilation))
            else:
                y = F.conv2d(h, self.weight, self.bias, (1, *self.stride), (0, *self.padding), (1, *self.dilation),
                             self.groups)
            return y.squeeze(2).to(x.dtype)
        if self.transposed:
            y = F.conv_transpose1d(h, self.weight, self.bias, self.stride, self.padding, self.output_padding,
                                   self.groups, self.dilation)
        else:
            y = F.conv1d(h, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        return y.to(x.dtype)


def _plain_conv(m: nn.Module) -> bool:
    """A plain `nn.Conv1d` / `nn.ConvTranspose1d`, weight-normed or not; not a subclass with its own forward (a
    causal conv's padding), which a `CastConv` would drop."""
    cls = type(m).__bases__[0] if parametrize.is_parametrized(m) else type(m)
    return cls in (nn.Conv1d, nn.ConvTranspose1d)


def cast_hift_convs(hift: nn.Module, dtype: torch.dtype, time_major: bool = False) -> int:
    """Replace every plain conv of HiFT's body (`vocalis.token2wav.cv2.hift.hift_body`: pre/post convs,
    upsampling, resblocks, source downsampling) by a `CastConv` in `dtype`, time-major or not (in place); the F0
    predictor, the source and causal convs (CosyVoice 3's) stay as they are. Returns how many."""
    n = 0
    for name in ("conv_pre", "conv_post"):
        if _plain_conv(getattr(hift, name)):
            setattr(hift, name, CastConv(getattr(hift, name), dtype, time_major))
            n += 1
    return n + sum(swap_modules(getattr(hift, name), _plain_conv, lambda m: CastConv(m, dtype, time_major))
                   for name in ("ups", "source_downs", "source_resblocks", "resblocks"))


def cast_linears(module: nn.Module, dtype: torch.dtype) -> int:
    """Replace every `nn.Linear` below `module` by a `CastLinear` (in place); returns how many."""
    return swap_modules(module, lambda m: type(m) is nn.Linear, lambda m: CastLinear(m, dtype))


def quantize_linears_int8(module: nn.Module) -> int:
    """Dynamic int8 quantization of every `nn.Linear` below `module` (in place, CPU); returns how many."""
    count = sum(1 for m in module.modules() if type(m) is nn.Linear)
    use_x86_quantized_engine()
    with warnings.catch_warnings():  # eager dynamic quantization is deprecated upstream but present in torch 2.13
        warnings.simplefilter("ignore")
        torch.ao.quantization.quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8, inplace=True)
    return count
