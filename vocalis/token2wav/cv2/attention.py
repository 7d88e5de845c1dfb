"""Attention pieces of the incremental estimator's two-part attention: attention that also returns each query's
log-sum-exp (`attend`), and the exact merge of two partial attentions by their log-sum-exps (`merge`)."""

from __future__ import annotations

import torch

from vocalis.kernels import bf16_attention, fp32_attention


def runs_native(q: torch.Tensor) -> bool:
    """Whether `attend(..., native=True)` runs q (B, H, n, E) on one of our kernels here (bf16 on AMX or
    AVX512-BF16 CPUs, fp32 on any CPU with the native extension), which take the mask as per-query key limits."""
    return bf16_attention.supports(q) or fp32_attention.supports(q)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
           limits: torch.Tensor | None = None, heads_first: bool = True, native: bool = True,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention q (B, H, n, E) over k, v (B, H, L, E), additive bias (B, 1, n, L) or None -> output
    (B, H, n, E), or (B, n, H, E) when not heads_first, and the log-sum-exp of each query's scaled, biased
    scores (B, H, n), for `merge`. limits: the bias as per-query key limits (`bf16_attention.limits_of`),
    required where our kernels run (`runs_native(q)`, unless `native` is False: torch's kernel then) and bias is not
    None."""
    if native and bf16_attention.supports(q):
        return bf16_attention.attend(q, k, v, limits, heads_first)
    if native and fp32_attention.supports(q):
        return fp32_attention.attend(q, k, v, limits, heads_first)
    if q.device.type == "cpu":  # the fused CPU kernel SDPA dispatches to, which also returns the log-sum-exp
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias)
        return out if heads_first else out.transpose(1, 2).contiguous(), lse
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    return out if heads_first else out.transpose(1, 2).contiguous(), lse


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
          dest: torch.Tensor) -> None:
    """Write into dest the attention over keys A and B together, from each part's output (..., n, E) and
    log-sum-exp (..., n): the parts' softmax weights are exp(lse_a), exp(lse_b) up to a common factor, so part
    B's share is sigmoid(lse_b - lse_a) (no overflow: the difference, not the exponentials)."""
    share = torch.sigmoid(lse_b - lse_a).unsqueeze(-1).to(out_a.dtype)  # (..., n, 1)
    torch.lerp(out_a, out_b, share, out=dest)
