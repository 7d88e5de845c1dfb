"""Token tables stored in reduced precision and looked up row by row: only the rows asked for are widened back to
fp32. Qwen's text table (151,936 x 896 at the 0.5B shapes, 545 MB in fp32) is the largest single tensor of the
speech LM and is only ever read a prompt's few rows at a time, so it is stored in the precision the LLM runs in.

- int8: each row symmetric int8 with its own fp32 scale (row = q * scale); an element's error is at most half a
  step, max|row| / 254, the per-output-channel rule of the int8 Linear layers.
- bf16 / fp16: the rows rounded to that dtype (relative error at most 2^-8 / 2^-11).
"""

from __future__ import annotations

import torch
from torch import nn

INT8_MAX = 127


class ReducedEmbedding(nn.Module):
    """`nn.Embedding` (no padding row, no max_norm) with rows held as `int8` plus per-row scales, or in a reduced
    float dtype; ids (...) -> rows (..., D) in the original dtype."""

    def __init__(self, embedding: nn.Embedding, dtype: torch.dtype) -> None:
        super().__init__()
        if embedding.max_norm is not None:
            raise ValueError("ReducedEmbedding stores fixed rows; an embedding with max_norm rescales them")
        w = embedding.weight.detach()  # (V, D)
        self.num_embeddings, self.embedding_dim = w.shape
        self.out_dtype = w.dtype
        scale: torch.Tensor | None = None
        if dtype == torch.int8:
            scale = (w.abs().amax(dim=1, keepdim=True).float() / INT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
            rows = torch.empty(w.shape, dtype=torch.int8, device=w.device)
            step = 1 << 14  # rows quantised a block at a time: no fp32 temporary of the whole table
            for i in range(0, w.shape[0], step):
                rows[i:i + step] = torch.round(w[i:i + step].float() / scale[i:i + step]).clamp_(-INT8_MAX, INT8_MAX)
        else:
            rows = w.to(dtype)
        self.register_buffer("rows", rows, persistent=False)  # (V, D)
        self.register_buffer("scale", scale, persistent=False)  # (V, 1) fp32, int8 rows only

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.rows[ids].to(self.out_dtype)  # (..., D)
        return rows if self.scale is None else rows * self.scale[ids].to(self.out_dtype)

    def nbytes(self) -> int:
        return self.rows.nbytes + (0 if self.scale is None else self.scale.nbytes)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows {self.rows.dtype}"
