"""The attention kernels' tests' oracle: float64 attention under per-query key limits."""

from __future__ import annotations

import torch


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    limits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of q (B, H, n, E) over k, v (B, H, L, E) with keys [0, limit) visible per query (limits
    (B, n)) -> out (B, H, n, E), lse (B, H, n); a query that sees nothing gets zeros and -1e10."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, H, n, L)
    lim = limits.long()[:, None, :, None].expand(q.shape[0], 1, q.shape[2], 1)  # (B, 1, n, 1)
    visible = torch.arange(k.shape[2])[None, None, None, :] < lim
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.nan_to_num(torch.softmax(scores, -1)) @ v
    none = (lim[..., 0] == 0).expand_as(lse)
    return out.masked_fill(none[..., None], 0.0), lse.masked_fill(none, -1e10)
