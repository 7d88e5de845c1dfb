"""The token2wav estimator's attention alone: our kernels (`vocalis.kernels.bf16_attention`, every kernel this CPU
runs; `fp32_attention` at the AVX2 level) against torch's fused CPU kernel in fp32 and in bf16, at the 0.5B
estimator's head shapes.

Shapes (batch rows = 2 guidance rows per request, 8 heads of 64): a full-attention final pass (250 frames = a 3 s
prompt and a 2 s utterance), a first chunk (100 new frames over 200 keys) and a later one (50 over 300), and a
step of 8 requests' full passes. q is a strided view of a fused q/k/v projection, as the estimator passes it.

    python benchmarks/bench_attention.py --threads 2
    # as on an AVX2 CPU (our avx2 set, torch's, oneDNN's and fbgemm's AVX2 code):
    VOCALIS_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \
        python benchmarks/bench_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from vocalis.kernels import bf16_attention, fp32_attention

SHAPES = ((2, 250, 250), (2, 100, 200), (2, 50, 300), (16, 250, 250))  # (rows, queries, keys)
HEADS, HEAD_DIM = 8, 64


def per_call_ms(fn: Callable[[], object], seconds: float) -> float:
    for _ in range(3):
        fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn()
        calls += 1
    return elapsed / calls * 1e3


def sides(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Each kernel's call on q, k, v (fp32) or their bf16 copies."""
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    calls: dict[str, Callable[[], object]] = {
        "torch fp32": lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v),
        "torch bf16": lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qb, kb, vb),
    }
    for which in bf16_attention.kernels():
        calls[f"ours {which}"] = lambda which=which: bf16_attention.attend(qb, kb, vb, None, which=which)
    if fp32_attention.available():
        calls["ours fp32"] = lambda: fp32_attention.attend(q, k, v, None)
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=1.0, help="timing per kernel and shape")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    ours = [*bf16_attention.kernels(), *(("fp32",) if fp32_attention.available() else ())]
    print(f"our kernels here: {', '.join(ours) or 'none'}")
    print("rows x queries x keys | kernel | ms per call | GFLOPS")
    for rows, n, length in SHAPES:
        q = torch.randn(rows, n, 3, HEADS, HEAD_DIM, generator=g)[:, :, 0].transpose(1, 2)  # (B, H, n, E), strided
        k, v = (torch.randn(rows, HEADS, length, HEAD_DIM, generator=g) for _ in range(2))
        flops = 4 * rows * HEADS * n * length * HEAD_DIM
        for name, fn in sides(q, k, v).items():
            ms = per_call_ms(fn, args.seconds)
            print(f"{rows} x {n} x {length} | {name} | {ms:.3f} | {flops / ms / 1e6:.0f}")


if __name__ == "__main__":
    main()
