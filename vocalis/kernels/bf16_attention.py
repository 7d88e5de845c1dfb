"""bf16 attention for the token2wav estimator on AMX CPUs (bf16_attention.cpp): oneDNN's tile kernel for the
two products, softmax in between, with every mask given as per-query key limits.

Why: torch's fused CPU attention costs ~0.3 ms alone and ~0.47 ms inside a token2wav step for a first chunk's
2 x 8 heads of 100 queries over 200 keys, several times its arithmetic, and under a mask it works on every key.
The estimator's masks are all "query i sees keys [0, limit_i)" (block-causal, padding at the end), so keys past
a tile's limits are skipped and the rest weighted exactly 0.

Math: scores q k^T in fp32, scaled, softmax in fp32 (exp to ~1e-7 relative), weights rounded to bf16 before
p v (fp32 accumulation), normalized by the sum of the rounded weights, output rounded to bf16; the log-sum-exp
of the scaled scores (for `token2wav.attention.merge`). A query with no visible key: zeros, log-sum-exp -1e10.
Runs where `bf16_gemm.available()` (same kernel, same conditions) and the head size is even, at most 64.
Legend: B batch rows, H heads, n queries, L keys, E head size.
"""

from __future__ import annotations

import torch

from vocalis.kernels import bf16_gemm, build

_ALL_VISIBLE = torch.empty(0, dtype=torch.int32)


def supports(q: torch.Tensor) -> bool:
    """Whether q (B, H, n, E) can go through the kernel here: bf16 on a CPU with the kernel, E even, <= 64."""
    return (q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[-1] % 2 == 0 and q.shape[-1] <= 64
            and bf16_gemm.available())


def limits_of(bias: torch.Tensor) -> torch.Tensor:
    """An additive mask (B, 1, n, L) whose visible keys (bias 0) are a prefix [0, limit) of each query's ->
    limits (B, n) int32."""
    return (bias[:, 0] == 0).sum(-1, dtype=torch.int32).contiguous()


def attend(q: torch.Tensor, k: torch.Tensor | list[torch.Tensor], v: torch.Tensor | list[torch.Tensor],
           limits: torch.Tensor | None, heads_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, n, E), k, v (B, H, L, E) bf16 (last dim contiguous), or lists of such pieces whose concatenation
    along dim 2 are the keys and values (a piece may have fewer batch rows, a divisor of B: row b reads row
    b % rows, as a voice prefix shared by request pairs); limits (1 or B, n) int32 or None (every key visible)
    -> out (B, H, n, E) when heads_first else (B, n, H, E), and log-sum-exp (B, H, n) fp32."""
    ext = build.extension()
    ks, vs = (k, v) if isinstance(k, list) else ([k], [v])
    out, lse = ext.bf16_attention(q, ks, vs, _ALL_VISIBLE if limits is None else limits, q.shape[-1] ** -0.5,
                                  heads_first)
    return out, lse
