"""bf16 attention for the token2wav estimator (bf16_attention.cpp), with every mask given as per-query key limits:
the two products on oneDNN's tile kernel on AMX CPUs ("tile"), or on our AVX512-BF16 dot-product loops on CPUs
with that and no AMX ("dot"), softmax in between.

Why: torch's fused CPU attention costs several times its arithmetic for a first chunk's 2 x 8 heads of 100 queries
over 200 keys, and under a mask it works on every key.
The estimator's masks are all "query i sees keys [0, limit_i)" (block-causal, padding at the end), so keys past
a tile's limits are skipped and the rest weighted exactly 0.

Math: scores q k^T in fp32, scaled, softmax in fp32 (exp to ~1e-7 relative), weights rounded to bf16 before
p v (fp32 accumulation), normalized by the sum of the rounded weights, output rounded to bf16; the log-sum-exp
of the scaled scores (for `token2wav.cv2.attention.merge`). A query with no visible key: zeros, log-sum-exp -1e10.
"tile" runs where `bf16_gemm.available()` (same kernel, same conditions), "dot" wherever the CPU has AVX512-BF16
at an AVX-512 level; "dot" is the default where "tile" does not run (no AMX, or an AMX CPU forced below it with
`VOCALIS_CPU_ISA=avx512_vnni`). Either needs an even head size of at most 64.
Legend: B batch rows, H heads, n queries, L keys, E head size.
"""

from __future__ import annotations

import torch

from vocalis.kernels import bf16_gemm, build, cpu

_ALL_VISIBLE = torch.empty(0, dtype=torch.int32)
KERNELS = ("tile", "dot")
_kernels: tuple[str, ...] | None = None  # decided on first use


def kernels() -> tuple[str, ...]:
    """The kernels this CPU runs (at the level in use, with the native extension built), preferred first."""
    global _kernels
    if _kernels is None:
        feats = cpu.features()
        dot = feats.at_least("avx512") and feats.avx512_bf16 and build.extension() is not None
        found = (*(("tile",) if bf16_gemm.available() else ()), *(("dot",) if dot else ()))
        if not build.settled():
            return found  # compiling in the background: asked again once it is ready
        _kernels = found
    return _kernels


def reset() -> None:
    """Forget the decision (tests that force a CPU level)."""
    global _kernels
    _kernels = None


def kernel() -> str | None:
    """The kernel `attend` runs by default here: "tile" on AMX CPUs, "dot" on AVX512-BF16 ones, None elsewhere."""
    found = kernels()
    return found[0] if found else None


def supports(q: torch.Tensor) -> bool:
    """Whether q (B, H, n, E) can go through a kernel here: bf16 on a CPU with one, E even, <= 64."""
    return (q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[-1] % 2 == 0 and q.shape[-1] <= 64
            and kernel() is not None)


def limits_of(bias: torch.Tensor) -> torch.Tensor:
    """An additive mask (B, 1, n, L) whose visible keys (bias 0) are a prefix [0, limit) of each query's ->
    limits (B, n) int32."""
    return (bias[:, 0] == 0).sum(-1, dtype=torch.int32).contiguous()


def attend(q: torch.Tensor, k: torch.Tensor | list[torch.Tensor], v: torch.Tensor | list[torch.Tensor],
           limits: torch.Tensor | None, heads_first: bool = True, which: str | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, n, E), k, v (B, H, L, E) bf16 (last dim contiguous), or lists of such pieces whose concatenation
    along dim 2 are the keys and values (a piece may have fewer batch rows, a divisor of B: row b reads row
    b % rows, as a voice prefix shared by request pairs); limits (1 or B, n) int32 or None (every key visible)
    -> out (B, H, n, E) when heads_first else (B, n, H, E), and log-sum-exp (B, H, n) fp32. which: one of
    `kernels()` (None: `kernel()`)."""
    which = which or kernel()
    if which not in kernels():
        raise ValueError(f"bf16 attention kernel {which!r} does not run here (this CPU runs {list(kernels())})")
    ext = build.extension()
    ks, vs = (k, v) if isinstance(k, list) else ([k], [v])
    out, lse = ext.bf16_attention(q, ks, vs, _ALL_VISIBLE if limits is None else limits, q.shape[-1] ** -0.5,
                                  heads_first, which == "dot")
    return out, lse
