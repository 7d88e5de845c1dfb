"""A conv block's LayerNorm over channels followed by Mish in one pass, for the token2wav estimator's torch path
(fp32_pointwise_avx2.cpp: AVX2 + FMA code, built into both source sets).

Why: where the estimator's GEMMs run in int8 (CPUs without the bf16 block kernels), torch's four passes for it
(LayerNorm, softplus, tanh, product) are a visible share of a token2wav step at its small sizes; the kernel reads
each frame's channels from L1 and writes every value once (`python benchmarks/bench_pointwise.py` prints both).

Math: LayerNorm as torch's (biased variance, eps inside the square root), then Mish(y) = y * m / (m + 2) with
m = e^y (e^y + 2), y itself past 20. Results equal torch's within a few fp32 ulps of the output's scale.
Legend: B batch rows, C channels, T frames.
"""

from __future__ import annotations

import torch
from torch import nn

from vocalis.kernels import build


def available() -> bool:
    """Whether the kernel runs here (the native extension is built and loaded)."""
    ext = build.extension()
    return ext is not None and hasattr(ext, "fp32_norm_mish")


def supports(x: torch.Tensor) -> bool:
    """Whether x can go through the kernel here: fp32 on a CPU with it, outside autograd."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad)
            and available())


def norm_mish(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor | None:
    """Mish(norm(x over C)) for x (B, C, T) fp32 stored channel-major or time-major -> (B, C, T) in x's layout,
    None where x is stored otherwise."""
    if not (x.is_contiguous() or x.transpose(1, 2).is_contiguous()):
        return None
    return build.extension().fp32_norm_mish(x, norm.weight, norm.bias, norm.eps)
