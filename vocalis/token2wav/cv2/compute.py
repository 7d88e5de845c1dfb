"""Reduced-dtype compute for the token2wav engine's incremental estimator (and its full-attention passes, which
run on the same path): each layer's weights as its GEMM takes them (the native bf16 GEMM's packed panels on AMX
CPUs, or torch's (weight, bias)), made once per engine."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vocalis.kernels import bf16_attention, bf16_gemm
from vocalis.models.flow.transformer import BasicTransformerBlock, SelfAttention
from vocalis.precision.conv_gemm import columns, columns_after, gemm_weight
from vocalis.precision.layers import CastLinear

# a layer's weights as its GEMM takes them: packed for the native bf16 GEMM, or (weight, bias) for torch's
Gemm = bf16_gemm.PackedWeight | tuple[torch.Tensor, torch.Tensor | None]


class ComputeWeights:
    """Reduced-dtype compute for the engine's incremental estimator (bf16 on CPUs with native bf16 GEMMs; fp16 on
    GPUs): weights converted once per module and kept for the engine's life.

    Every Linear and causal conv runs as a GEMM in `dtype` (fp32 accumulation inside the kernel) on inputs cast
    down, q/k/v fused into one GEMM, the feed-forward's 4D-wide hidden kept reduced between its two GEMMs; each
    result is widened to fp32 before it joins the residual stream. A k-tap causal conv is one GEMM over its k
    shifted inputs side by side (im2col). Norms, activations, the time embedding and the Euler state stay fp32,
    and so does attention except on CPUs that run our bf16 attention (`reduced_attention`). Without it (fp32,
    int8) the modules run as they are."""

    def __init__(self, dtype: torch.dtype, packed: bool | None = None, native: bool | None = None,
                 native_attention: bool = True) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"compute dtype must be bf16 or fp16, got {dtype}")
        self.kind = dtype
        # Our own bf16 GEMM loop around oneDNN's tile kernel (`bf16_gemm`), bias/GELU/residual add fused: on AMX
        # CPUs it replaces the prepacked oneDNN call, whose per-call overhead rivals its kernel time at these
        # shapes. Decided on first use (CPU bf16 weights with even K; `bf16_gemm.available()`) unless given.
        self.native = native
        # oneDNN's prepacked bf16 GEMM (weights reordered once into the kernel's blocked layout, an optional GELU
        # fused into the GEMM): the plain bf16 GEMM reorders the weights on every call, which dominates at the
        # estimator's shapes on AMX CPUs. Decided on first use (CPU tensors only).
        self.packed = packed
        # Attention in the compute dtype too where the CPU runs our bf16 attention (`bf16_attention`: AMX tiles,
        # or AVX512-BF16 dot products): it is then the faster kernel, and q/k/v, the bf16 key/value caches and the
        # output projection's input stay bf16 (no casts). Elsewhere torch's fp32 attention; GPUs keep fp32.
        self.reduced_attention = dtype == torch.bfloat16 and bf16_attention.kernel() is not None
        # whether that attention runs on our kernel (False: torch's, on the same bf16 inputs)
        self.native_attention = native_attention
        self._cache: dict[int, tuple[nn.Module, Gemm]] = {}
        self._blocks: dict[int, tuple[nn.Module, bf16_gemm.BlockWeights | None]] = {}

    def _gemm(self, key: nn.Module, weights: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
              ) -> Gemm:
        """`key`'s weights as its GEMM runs them: a `bf16_gemm.PackedWeight` (native), or (weight (N, K), bias
        (N,)) in the compute dtype, prepacked for oneDNN when `packed`; `weights()` (fp32, any layout work such as
        fusing or reordering) runs on first use only."""
        hit = self._cache.get(id(key))
        if hit is None or hit[0] is not key:
            weight, bias = weights()
            if self.native is None:
                self.native = bf16_gemm.serves(self.kind, weight.device)
            if self.native and bf16_gemm.supports(weight):
                hit = self._cache[id(key)] = (key, bf16_gemm.pack(weight, bias))
                return hit[1]
            weight = weight.detach().to(self.kind)
            if self.packed is None:
                self.packed = weight.device.type == "cpu" and _packed_gemm_works(weight)
            if self.packed:
                weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS)
            hit = self._cache[id(key)] = (key, (weight, None if bias is None else bias.detach().to(self.kind)))
        return hit[1]

    def _run(self, gemm: Gemm, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """x (M, K) -> (M, N) in the compute dtype (2-D: the CPU bf16 GEMM's fast path), GELU applied when
        `gelu` (exact, erf)."""
        if isinstance(gemm, bf16_gemm.PackedWeight):
            return bf16_gemm.linear(x, gemm, gelu)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x.to(self.kind), *gemm, "gelu" if gelu else "none", [],
                                                      "none" if gelu else "")
        y = F.linear(x.to(self.kind), *gemm)
        return F.gelu(y) if gelu else y

    def linear(self, layer: nn.Module, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """Linear layer on x (..., K) -> (..., N), output in the compute dtype; `gelu`: GELU(layer(x))."""
        gemm = self._gemm(layer, lambda: (layer.weight, layer.bias))
        return self._run(gemm, x.reshape(-1, x.shape[-1]), gelu).view(*x.shape[:-1], -1)

    def linear_add_(self, residual: torch.Tensor, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """residual (..., N) fp32 += layer(x (..., K)), in place where the native GEMM runs the layer (the add fused
        into its write, no rounding of the layer's output); otherwise a new tensor, the layer's output in the
        compute dtype widened by the add (exact, as a separate cast would be)."""
        gemm = self._gemm(layer, lambda: (layer.weight, layer.bias))
        if isinstance(gemm, bf16_gemm.PackedWeight) and residual.is_contiguous():
            bf16_gemm.linear_add_(residual.view(-1, residual.shape[-1]), x.reshape(-1, x.shape[-1]), gemm)
            return residual
        return residual + self.linear(layer, x)

    def block_weights(self, block: BasicTransformerBlock) -> bf16_gemm.BlockWeights | None:
        """A transformer block's weights for `bf16_gemm`'s one-call block (packed GEMMs, fp32 norms and biases),
        or None where it cannot run it (not native, no affine norms, biased q/k/v, an odd or over-64 head size)."""
        hit = self._blocks.get(id(block))
        if hit is not None and hit[0] is block:
            return hit[1]
        attn, ff_in, ff_out = block.attn1, block.ff.net[0].proj, block.ff.net[2]
        weights = None
        if (self.native is not False and self.kind == torch.bfloat16 and attn.head_dim % 2 == 0
                and attn.head_dim <= 64 and all(m.bias is None for m in (attn.to_q, attn.to_k, attn.to_v))
                and all(norm.weight is not None and norm.bias is not None for norm in (block.norm1, block.norm3))):
            packed = (self._gemm(attn, lambda: (torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]),
                                                None)),
                      *(self._gemm(m, lambda m=m: (m.weight, m.bias)) for m in (attn.to_out[0], ff_in, ff_out)))
            if all(isinstance(g, bf16_gemm.PackedWeight) for g in packed):
                qkv, out, ff1, ff2 = packed
                weights = bf16_gemm.BlockWeights(block.norm1, block.norm3, attn.num_heads, attn.head_dim, qkv, out,
                                                 ff1, ff2)
        self._blocks[id(block)] = (block, weights)
        return weights

    def qkv(self, attn: SelfAttention, x: torch.Tensor) -> torch.Tensor:
        """Fused (bias-free) q/k/v projections: x (M, D) -> (M, 3 * H * E) in the compute dtype."""
        gemm = self._gemm(attn, lambda: (torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]), None))
        return self._run(gemm, x)  # weight (3 * H * E, D)

    def conv(self, conv: nn.Conv1d, x: torch.Tensor, left: torch.Tensor | None = None) -> torch.Tensor:
        """Causal conv as one GEMM: x (B, C_in, n), left (B, C_in, k - 1) the frames before it (None: k == 1)
        -> (B, C_out, n) fp32. Natively (`bf16_gemm.conv`) the taps are read in place from a time-major bf16 copy
        of (left, x), and the result comes back time-major (a transposed view): the norm after it reads it as is."""
        c_out, c_in, k = conv.weight.shape
        gemm = self._gemm(conv, lambda: (gemm_weight(conv.weight), conv.bias))  # (C_out, k * C_in)
        if isinstance(gemm, bf16_gemm.PackedWeight):
            left = x.new_empty(x.shape[0], c_in, 0) if left is None else left
            return bf16_gemm.conv(x.float(), left.float(), gemm, k)
        cols = columns(x, k) if left is None else columns_after(left, x, k)  # (B, n, k * C_in)
        y = self._run(gemm, cols.reshape(-1, k * c_in))  # (B * n, C_out)
        return y.view(cols.shape[0], cols.shape[1], c_out).transpose(1, 2).float()

    @staticmethod
    def dtype_for(estimator: nn.Module) -> torch.dtype | None:
        """The dtype the engine's reduced compute runs `estimator` in: the one dtype of its `CastLinear` weights
        when that is bf16 or fp16 and every Linear holds float weights (`supports`); None: the modules as they are
        (fp32, or int8 Linears)."""
        dtypes = {m.weight.dtype for m in estimator.modules() if isinstance(m, CastLinear)}
        dtype = next(iter(dtypes)) if len(dtypes) == 1 else None
        return dtype if dtype in (torch.bfloat16, torch.float16) and ComputeWeights.supports(estimator) else None

    @staticmethod
    def supports(estimator: nn.Module) -> bool:
        """Whether every Linear of the estimator holds float weights (none is, e.g., a quantized module)."""
        linears = [m for m in estimator.modules() if type(m).__name__ in ("Linear", "CastLinear")]
        return all(type(m).__module__.startswith("torch.nn") or type(m).__name__ == "CastLinear" for m in linears)


_PACK_ROWS = 128  # the row count oneDNN picks its packed layout for; any row count runs on it


def _packed_gemm_works(weight: torch.Tensor) -> bool:
    """Whether this torch build runs oneDNN's prepacked GEMM for `weight`'s dtype on the CPU (and agrees with
    the plain GEMM), checked once on a small problem."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(16, 32, generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1)).to(weight.dtype)
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS), None,
                                               "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    ref = F.linear(x.float(), w.float())
    return y.shape == ref.shape and bool(torch.allclose(y.float(), ref, rtol=2e-2, atol=5e-2))
