"""CPU weight layout for decoding: fused q/k/v and gate/up weights, every weight in its usual (out, in) rows.

Decoding multiplies a few rows by every weight, so the step is a string of skinny GEMMs whose speed depends on
their count: fewer, wider GEMMs (3 projections -> 1, gate + up -> 1) cut the per-call costs. `gemm` picks the
kernel by row count and weight size: MKL for a few rows or a small weight, oneDNN from `ONEDNN_MIN_ROWS` rows on a
weight of `ONEDNN_MIN_WEIGHT` elements or more (faster there).

One layout for both decode paths: every weight stays (out, in) row-major, q/k/v and gate/up concatenated along
`out` into one contiguous (sum out, in) tensor. The fused decode step (int8_decode) streams 64-channel panels of
these rows from this very storage, and the per-op path (prefill, > 4 rows, or the fused step off) multiplies by
their transposed views. Why not an (in, out) layout: MKL's NN GEMM runs the wide
projections faster at batch 1, but batch-1..4 decode steps run fused, and keeping (in, out) for the per-op path
would force the fp32 fused step to hold a second, (out, in) copy of q/k/v and
gate/up (~0.94 GB at the 0.5B shapes). The speech head stays (out, in) too (the fused step reads it).

The packing is in place and costs no memory: each module's `weight` (and bias) becomes a view into the fused
storage with its usual shape and values (a contiguous row range), so the modules, the reference path and
`state_dict()` keep working. Plain fp32 `nn.Linear` layers and the bf16 backend's `CastLinear` layers are packed
this way (bf16 storage for the latter: `gemm` multiplies their input rounded to bf16, as `CastLinear` does); a
layer otherwise replaced is left to its module, except the int8 backend's `Int8Linear` layers (our VNNI kernel,
`int8_gemv`), whose packed int8 weights are fused the same way (q, k, v and gate, up concatenated; the modules
keep views) and which `gemm` runs through the kernel.

Legend: D hidden, Dq = H*Dh, Dkv = Hkv*Dh, I intermediate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vocalis.adapters.batched import unwrap
from vocalis.engine.lm_family import SpeechLM
from vocalis.models.qwen2 import Qwen2DecoderLayer
from vocalis.precision.int8_linear import Int8Linear, Int8Weight, fuse, int8_linear
from vocalis.precision.layers import CastLinear


@dataclass(frozen=True, slots=True)
class PackedLayer:
    # fp32 or bf16: (in, out) views of (out, in) row-major storage (`.t()` of each is contiguous: the rows the fused
    # step reads); int8 (`Int8Weight`, its bias inside): the same products packed for the kernel
    qkv_t: torch.Tensor | Int8Weight  # (D, Dq + 2 Dkv): the fused (Dq + 2 Dkv, D) storage, transposed
    qkv_bias: torch.Tensor | None  # (Dq + 2 Dkv,)
    gate_up_t: torch.Tensor | Int8Weight  # (D, 2 I): the fused (2 I, D) storage (gate rows, then up), transposed
    o_t: torch.Tensor | Int8Weight  # (Dq, D): o_proj.weight.t(), a view (the module keeps its (out, in) storage)
    down_t: torch.Tensor | Int8Weight  # (I, D): down_proj.weight.t(), a view
    q_dim: int
    kv_dim: int


def _plain(*linears: nn.Module) -> bool:
    return all(type(m) is nn.Linear and m.weight.dtype == torch.float32 for m in linears)


def _bf16(*linears: nn.Module) -> bool:
    return all(type(m) is CastLinear and m.weight.dtype == torch.bfloat16 for m in linears)


def _half(*linears: nn.Module) -> bool:
    """A whole-cast model's layers (`backends.half`): plain Linears holding one half dtype, fed that dtype."""
    if not all(type(m) is nn.Linear for m in linears):  # (other layers' `weight` may be a method: torch's int8)
        return False
    dtypes = {m.weight.dtype for m in linears}
    return len(dtypes) == 1 and dtypes <= HALF_DTYPES


def _fuse(linears: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights along `out` into one (sum out, in) contiguous tensor (and the biases into one
    vector); the modules' weights and biases become views into them (row ranges, still contiguous)."""
    fused = torch.cat([m.weight.detach() for m in linears])  # (sum out, in)
    bias = torch.cat([m.bias.detach() for m in linears]) if all(m.bias is not None for m in linears) else None
    start = 0
    for m in linears:
        n = m.out_features
        m.weight.data = fused[start:start + n]
        if bias is not None:
            m.bias.data = bias[start:start + n]  # type: ignore[union-attr]
        start += n
    return fused, bias


HALF_DTYPES = frozenset((torch.bfloat16, torch.float16))
ONEDNN_MIN_ROWS = 4
# oneDNN's per-call cost exceeds its gain on narrow weights (the built-in model's 256-wide layers, up to 256 x 1536):
# MKL there; the 0.5B shapes (896 x 896 and up) keep oneDNN
ONEDNN_MIN_WEIGHT = 768 * 1024
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def gemm(x: torch.Tensor, w_t: torch.Tensor | Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ w_t (K, N) [+ bias (N,)] -> (M, N), fp32, any layout of w_t; an `Int8Weight` (which
    holds its own bias) runs through the int8 kernel.

    MKL's GEMM for a few rows; from ONEDNN_MIN_ROWS rows oneDNN's (the op `torch.compile` itself lowers CPU
    linears to), faster than MKL's for batch 4-16 decode GEMMs on weights of ONEDNN_MIN_WEIGHT elements or more
    (on smaller ones its per-call cost outweighs the gain). Half-precision weights: x in another dtype is
    `CastLinear`'s arithmetic (rounded to the weights' dtype, the result widened back); x in their dtype (a
    whole-cast model) multiplies as it is, the output in that dtype."""
    if isinstance(w_t, Int8Weight):
        return int8_linear(x, w_t)
    if w_t.dtype != x.dtype:  # `CastLinear`'s bf16 weights: its arithmetic (input rounded to bf16), fp32 out
        return F.linear(x.to(w_t.dtype), w_t.t(), bias).to(x.dtype)
    if w_t.dtype in HALF_DTYPES:  # a whole-cast model: in and out in the weights' dtype, no cast either side
        return F.linear(x, w_t.t(), bias)
    # (under torch.compile the plain op: the compiler picks the CPU kernel itself and cannot lower this one)
    if (_ONEDNN and x.shape[0] >= ONEDNN_MIN_ROWS and w_t.numel() >= ONEDNN_MIN_WEIGHT and x.is_cpu
            and not torch.compiler.is_compiling()):
        return torch.ops.mkldnn._linear_pointwise(x, w_t.t(), bias, "none", [], "")
    return torch.mm(x, w_t) if bias is None else torch.addmm(bias, x, w_t)


def _pack_int8(linears: Sequence[Int8Linear]) -> PackedLayer | None:
    """Fuse an int8 layer's packed q/k/v and gate/up weights (the modules keep views); None if they cannot."""
    q, k, v, o, gate, up, down = linears
    qkv_mods, gate_up_mods = [q, k, v], [gate, up]
    qkv, gate_up = fuse([m.packed for m in qkv_mods]), fuse([m.packed for m in gate_up_mods])
    if qkv is None or gate_up is None:
        return None
    for mods, (_, views) in ((qkv_mods, qkv), (gate_up_mods, gate_up)):
        for m, view in zip(mods, views):
            m.packed = view
    # the int8 kernel runs prefill rows too: a bf16 copy for oneDNN's AMX GEMM would cost 2 bytes more per weight
    # and was not faster than the kernel at the 0.5B shapes (docs/benchmarks.md, "End to end on 2-core CPUs")
    return PackedLayer(qkv[0], None, gate_up[0], o.packed, down.packed, q.out_features, k.out_features)


def _weight_ptr(m: nn.Module) -> int:
    return m.packed.w.data_ptr() if isinstance(m, Int8Linear) else m.weight.data_ptr()


def pack_layer(layer: Qwen2DecoderLayer) -> PackedLayer | None:
    """Fuse one layer's weights in place (None where they cannot be). The Linear layers a LoRA bank wrapped
    (`adapters.batched.BankedLinear`) are packed by their base weights: the bank's updates are added to the packed
    GEMMs' outputs (`adapters.packed`)."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = tuple(unwrap(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                                        mlp.up_proj, mlp.down_proj))
    done = getattr(layer, "_vocalis_packed", None)
    if isinstance(done, PackedLayer) and _weight_ptr(linears[0]) == (
            done.qkv_t.w if isinstance(done.qkv_t, Int8Weight) else done.qkv_t).data_ptr():
        return done  # packed before (another engine over the same model)
    int8 = [m for m in linears if type(m) is Int8Linear]
    if len(int8) == len(linears):
        packed = _pack_int8(int8)
        if packed is not None:
            layer._vocalis_packed = packed  # type: ignore[attr-defined]
        return packed
    if not (_plain(*linears) or _bf16(*linears) or _half(*linears)):
        return None
    q, k, v, o, gate, up, down = linears
    qkv, qkv_bias = _fuse([q, k, v])  # (Dq + 2 Dkv, D)
    gate_up, _ = _fuse([gate, up])  # (2 I, D)
    assert qkv_bias is not None
    packed = PackedLayer(qkv.t(), qkv_bias, gate_up.t(), o.weight.t(), down.weight.t(), q.out_features,
                         k.out_features)
    layer._vocalis_packed = packed  # type: ignore[attr-defined]
    return packed


def pack_llm(llm: SpeechLM) -> list[PackedLayer | None]:
    """Pack every decoder layer (None where a layer cannot be). In place, once."""
    return [pack_layer(layer) for layer in llm.qwen.layers]
