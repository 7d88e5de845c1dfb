"""The token2wav estimator's passes around its GEMMs alone, at the 0.5B estimator's shapes: a conv block's LayerNorm
+ Mish on our one-pass kernel (`vocalis.kernels.fp32_pointwise`) against torch's four passes, on both layouts the
estimator hands it; a resnet's 1x1 residual conv as a GEMM over time-major frames against oneDNN's conv; and a causal
conv's GEMM input (k = 3) built natively from its cached context (`conv_gemm.columns_after`) against torch's
concatenation and shifted copies.

Shapes (batch rows = 2 guidance rows per request, 256 channels): a first chunk (100 frames), a later chunk (50),
and a step of 8 requests' chunks.

    python benchmarks/bench_pointwise.py --threads 2
    # as on an AVX2 CPU (our avx2 set, torch's, oneDNN's and fbgemm's AVX2 code):
    VOCALIS_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \
        python benchmarks/bench_pointwise.py --threads 2
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_attention import per_call_ms
from torch import nn

from vocalis.kernels import fp32_pointwise
from vocalis.kernels.heap import cap_mmap_threshold
from vocalis.precision.conv_gemm import columns, columns_after

SHAPES = ((2, 100), (2, 50), (16, 50))  # (rows, frames)
CHANNELS = 256


def torch_passes(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    y = norm(x.transpose(1, 2)).transpose(1, 2)
    return F.softplus(y).tanh_().mul_(y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=1.0, help="timing per side and shape")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cap_mmap_threshold()  # as the engine runs: tensors of these sizes come from the heap, not fresh mappings
    if not fp32_pointwise.available():
        raise SystemExit("the native extension is not built here (no compiler, or a CPU below AVX2)")
    g = torch.Generator().manual_seed(0)
    norm = nn.LayerNorm(CHANNELS)
    conv = nn.Conv1d(CHANNELS, CHANNELS, 1)
    w = conv.weight[:, :, 0]
    print("rows x frames | layout | LayerNorm + Mish: torch / ours us (x) | 1x1 conv: oneDNN / GEMM us (x) | "
          "conv columns: torch / ours us (x)")
    with torch.no_grad():
        for rows, frames in SHAPES:
            for layout in ("channel-major", "time-major"):
                x = (torch.randn(rows, CHANNELS, frames, generator=g) if layout == "channel-major" else
                     torch.randn(rows, frames, CHANNELS, generator=g).transpose(1, 2))
                base = per_call_ms(lambda x=x: torch_passes(x, norm), args.seconds) * 1e3
                ours = per_call_ms(lambda x=x: fp32_pointwise.norm_mish(x, norm), args.seconds) * 1e3
                line = f"{rows} x {frames} | {layout} | {base:.1f} / {ours:.1f} ({base / ours:.2f}x)"
                if layout == "time-major":  # the estimator runs its residual convs as GEMMs on this layout
                    c = per_call_ms(lambda x=x: conv(x), args.seconds) * 1e3
                    m = per_call_ms(lambda x=x: F.linear(x.transpose(1, 2), w, conv.bias), args.seconds) * 1e3
                    line += f" | {c:.1f} / {m:.1f} ({c / m:.2f}x)"
                    left = torch.randn(rows, CHANNELS, 2, generator=g)
                    a = per_call_ms(lambda x=x, left=left: columns(torch.cat([left, x], dim=2), 3), args.seconds) * 1e3
                    b = per_call_ms(lambda x=x, left=left: columns_after(left, x, 3), args.seconds) * 1e3
                    line += f" | {a:.1f} / {b:.1f} ({a / b:.2f}x)"
                print(line)


if __name__ == "__main__":
    main()
