"""The token2wav estimator's GEMMs alone, at the 0.5B shapes: fp32 (`F.linear`), the int8 estimator's fbgemm GEMM
(`Int8Linear`: 8-bit activations per call, per-channel weights) and our int8 kernel (`int8_linear`, the LLM's: per-row
activations; built for decode's few rows), in multiply-adds x 2 per second.

Rows = 2 guidance rows x frames x requests per step (100: one stream's later chunk; 200: a first chunk or two
streams' later chunks; 400: two streams' first chunks). Widths (K -> N): the fused q/k/v (256 -> 3 x 512), the
feed-forward's two (256 -> 1024, 1024 -> 256), the attention output (512 -> 256) and a conv block's k=3 conv as
one GEMM (768 -> 256).

    python benchmarks/bench_estimator_gemms.py --threads 2
    # as on an AVX2 CPU:
    VOCALIS_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \
        python benchmarks/bench_estimator_gemms.py --threads 2
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_attention import per_call_ms

from vocalis.kernels.heap import cap_mmap_threshold
from vocalis.precision import int8_linear
from vocalis.precision.dynamic_int8 import Int8Linear

ROWS = (100, 200, 400)
WIDTHS = ((256, 1536), (256, 1024), (1024, 256), (512, 256), (768, 256))  # (K, N)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=0.5, help="timing per GEMM and shape")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cap_mmap_threshold()  # as the engine runs: large outputs are mapped fresh, not served from a grown heap
    g = torch.Generator().manual_seed(0)
    ours = int8_linear.available()
    print("rows x K -> N | fp32 ms (GFLOPS) | fbgemm int8 ms (G ops/s) | our int8 kernel ms (G ops/s)")
    for rows in ROWS:
        for k, n in WIDTHS:
            w, b = torch.randn(n, k, generator=g) * k**-0.5, torch.randn(n, generator=g) * 0.01
            x = torch.randn(rows, k, generator=g)
            fbgemm = Int8Linear(w, b)
            calls = {"fp32": lambda x=x, w=w, b=b: F.linear(x, w, b), "fbgemm": lambda x=x, f=fbgemm: f(x)}
            if ours:
                packed = int8_linear.quantize_weight(w, b)
                calls["ours"] = lambda x=x, p=packed: int8_linear.int8_linear(x, p)
            ops = 2 * rows * k * n
            cells = [f"{ms:.3f} ({ops / ms / 1e6:.0f})" for ms in (per_call_ms(f, args.seconds) for f in calls.values())]
            print(f"{rows} x {k} -> {n} | {' | '.join(cells)}{'' if ours else ' | (not built here)'}")


if __name__ == "__main__":
    main()
