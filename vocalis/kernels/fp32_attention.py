"""fp32 attention for the token2wav estimator (fp32_attention_avx2.cpp: AVX2 + FMA code, built into both source
sets): the fp32 counterpart of `bf16_attention`, with every mask given as per-query key limits, for CPUs with no
bf16 arithmetic (AVX2, AVX-512 without BF16) and for fp32 compute anywhere.

Why: torch's fused CPU attention runs the estimator's small products (a first chunk: 2 x 8 heads of 100 queries
over 200 keys of 64) well under the CPU's FMA rate, and under a mask it works on every key. Here both products
run in register-blocked FMA loops and keys past a tile's limits are skipped (`python benchmarks/bench_attention.py`
prints both).

Math: scores q k^T in fp32, scaled, softmax in fp32 (exp to ~1e-7 relative), p v in fp32, normalized by the sum of
the weights; the log-sum-exp of the scaled scores (for `token2wav.cv2.attention.merge`). A query with no visible key:
zeros, log-sum-exp -1e10. Runs wherever the native extension is built (the CPU probe's level is avx2 or above);
head sizes up to 128.
Legend: B batch rows, H heads, n queries, L keys, E head size.
"""

from __future__ import annotations

import torch

from vocalis.kernels import build

_ALL_VISIBLE = torch.empty(0, dtype=torch.int32)
MAX_HEAD_SIZE = 128


def available() -> bool:
    """Whether the kernel runs here (the native extension is built and loaded)."""
    ext = build.extension()
    return ext is not None and hasattr(ext, "fp32_attention")


def supports(q: torch.Tensor) -> bool:
    """Whether q (B, H, n, E) can go through the kernel here: fp32 on a CPU with it, E <= 128."""
    return q.dtype == torch.float32 and q.device.type == "cpu" and q.shape[-1] <= MAX_HEAD_SIZE and available()


def attend(q: torch.Tensor, k: torch.Tensor | list[torch.Tensor], v: torch.Tensor | list[torch.Tensor],
           limits: torch.Tensor | None, heads_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, n, E) fp32, k, v (B, H, L, E) fp32 or bf16 (last dim contiguous; a bf16 cache is read where it
    lies, widened as the kernel packs it), or lists of such pieces along dim 2 (a piece may have fewer batch rows, a
    divisor of B: row b reads row b % rows); limits (1 or B, n) int32 or None (every key visible) -> out
    (B, H, n, E) when heads_first else (B, n, H, E), and log-sum-exp (B, H, n) fp32."""
    ext = build.extension()
    if ext is None or not hasattr(ext, "fp32_attention"):
        raise ValueError("the fp32 attention kernel does not run here (it needs the native extension)")
    ks, vs = (k, v) if isinstance(k, list) else ([k], [v])
    return tuple(ext.fp32_attention(q, ks, vs, _ALL_VISIBLE if limits is None else limits, q.shape[-1] ** -0.5,
                                    heads_first))
