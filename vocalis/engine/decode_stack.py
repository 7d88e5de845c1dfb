"""The LLM's decoder stack for decode steps of a few rows as one native call (int8_decode.cpp): int8, fp32 or bf16.

Why: with the VNNI kernel reading weights as fast as a copy, a batch-1 int8 decode step still spent a large share
of its time outside the GEMVs, in ~20 small torch ops per layer x 24 layers (RMSNorm, rotary, K/V writes, gathering
the context, SDPA, residual adds, SiLU * mul, quantising activations per GEMV, one thread-pool wake per op).
`FusedDecodeStack` runs every layer of a step (1..`max_rows` single-query rows, no prefill chunk) inside one
OpenMP parallel region: the threads split each GEMV by 64-channel panels (so the small q/k/v and o projections,
which `int8_linear` runs on one thread, use every thread too) and meet at 5 barriers per layer.

Same math as `ModelRunner.forward`'s int8 path (the same packed weights, per-row int8 activations, exact int32
sums); fp32 rounding differs (summation order in RMSNorm and attention, a polynomial exp), so an activation
rounding to int8 may flip by one step: outputs agree to ~1e-3 of their scale, not bit for bit (see the tests).

Used by `ModelRunner` when the kernel is built, every layer's weights are int8-packed (`packed_weights`), the
cache is fp32 and head_dim a multiple of 16, unless the engine's `EngineConfig.fused_decode` leaves "int8" out
(VOCALIS_INT8_FUSED=0); the per-op path remains for prefill, larger batches and every other precision.

fp32 weights get the same step (the native `F32DecodeStack`: the same phases, work claiming, attention, norm
and rotary code; the GEMVs are FMA dot products over 64-channel panels). It lives in the int8 kernel's
extension, so it needs its compiler and AVX2 or AVX-512 (not VNNI: `int8_gemv.fp32_unavailable_reason`), and the
first fp32 engine on a machine builds it.

Each step exists per instruction-set level (`kernels.build`): int8_decode.cpp, the phases and work claiming, is
compiled with the AVX-512 vector pieces (decode_math.cpp, int8_gemv.cpp) or the AVX2 ones (decode_math_avx2.cpp,
int8_gemv_avx2.cpp: 8-wide vectors, int16 products with exact int32 sums, row tiles of up to 4). A panel is 64 rows of a
weight in its usual (out, in) layout, one contiguous run, read from `packed_weights`' storage, which the per-op path
(prefill, > 4 rows) shares: no copy. Rounding differs from the per-op path only in summation order (and the polynomial
exp in softmax and SiLU). Leaving "fp32" out of `fused_decode` (VOCALIS_FP32_FUSED=0) turns the fp32 step off.

bf16 weights (the bf16 backend's `CastLinear` layers, packed by `packed_weights` in bf16) get it too
(`BF16DecodeStack`): the same panels at half the bytes, each weight widened to fp32 in registers, the input rows
rounded to bf16 first as `CastLinear` rounds them; fp32 sums. Why: op by op, a bf16 batch-1 step decoded slower than
fp32's fused step, every Linear costing two casts and a GEMM call. Leaving "bf16" out of `fused_decode`
(VOCALIS_BF16_FUSED=0) turns it off.

Every step also runs the final RMSNorm and the speech head (`forward_logits`) where the head is the stack's
kind: int8 packed for the kernel, or fp32 / bf16 (out, in) rows.

Legend: M rows, D hidden, L layers, S cache slots, Hkv key/value heads, Dh head width, Lmax context length.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

import torch
from torch import nn

from vocalis.engine.config import FUSED_DECODE_KINDS
from vocalis.engine.lm_family import SpeechLM
from vocalis.engine.packed_weights import PackedLayer
from vocalis.precision import int8_linear as int8_gemv
from vocalis.precision.int8_linear import Int8Linear, Int8Weight
from vocalis.precision.layers import CastLinear

log = logging.getLogger(__name__)

_NO_BIAS = torch.empty(0)


class FusedDecodeStack:
    """A native handle on one LLM's decoder layers, int8 or fp32 (it holds references to the weights)."""

    def __init__(self, native: object) -> None:
        self._native = native
        # every decode step of up to the kernel's row count runs fused (16: row tiles of 4 (AVX2) or 6 (AVX-512) over
        # weights streamed once per step, where the per-op path pays a GEMM call per layer and weight)
        self.max_rows = int(native.max_rows())  # type: ignore[attr-defined]
        self.has_head = False  # whether `forward_logits` applies (the final norm and the speech head are bound)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, write_slots: torch.Tensor, gather_slots: torch.Tensor,
                context_lens: torch.Tensor) -> torch.Tensor:
        """x (M, D) fp32 embeddings -> (M, D) hidden states after the last layer (x is updated in place).

        cos / sin_signed (M, Dh): rotary rows of each position (`ModelRunner`'s tables); k_cache / v_cache
        (L, S, Hkv, Dh): row m's new K/V go to slot write_slots[m]; gather_slots (M, Lmax): row m's context
        slots in position order, the first context_lens[m] real (its own new slot last)."""
        native = self._native
        return native.forward(x, cos, sin_signed, k_cache, v_cache, write_slots,  # type: ignore[attr-defined]
                              gather_slots, context_lens)

    def forward_logits(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, write_slots: torch.Tensor, gather_slots: torch.Tensor,
                       context_lens: torch.Tensor) -> torch.Tensor:
        """As `forward`, then the final RMSNorm and the speech head in the same native call: (M, V) fp32 logits of
        every row."""
        native = self._native
        return native.forward_logits(x, cos, sin_signed, k_cache, v_cache,  # type: ignore[attr-defined]
                                     write_slots, gather_slots, context_lens)

    def set_grace_ns(self, ns: int) -> None:
        """How long a thread out of work waits for a claimed item before computing it too (0: at once, which
        tests use to exercise the duplicate path; default 200 us int8, 400 us fp32)."""
        self._native.set_grace_ns(ns)  # type: ignore[attr-defined]


Int8DecodeStack = FusedDecodeStack  # the name before fp32 weights had the step too


def decode_stack(llm: SpeechLM, packed: Sequence[PackedLayer | None], cache_dtype: torch.dtype,
                 kinds: Collection[str] = FUSED_DECODE_KINDS) -> FusedDecodeStack | None:
    """The fused stack for `llm` (int8, fp32 or bf16 weights), or None where it does not apply or its kind is
    not in `kinds` (see the module doc; logged at debug)."""
    kind = _kind(packed)
    reason = _unsupported(llm, packed, cache_dtype, kind) if kind in kinds else f"{kind} not in fused_decode"
    if reason is not None:
        log.debug("fused %s decode step off: %s", kind, reason)
        return None
    ext = int8_gemv.extension()
    assert ext is not None
    if kind != "int8":
        return _with_head(_dense_stack(llm, packed, ext, kind), llm)
    q = llm.config.qwen
    tensors: list[torch.Tensor] = []
    for layer, pk in zip(llm.qwen.layers, packed):
        assert pk is not None
        qkv, o, gate_up, down = pk.qkv_t, pk.o_t, pk.gate_up_t, pk.down_t
        assert isinstance(qkv, Int8Weight) and isinstance(o, Int8Weight)
        assert isinstance(gate_up, Int8Weight) and isinstance(down, Int8Weight)
        tensors += [layer.input_layernorm.weight.detach().contiguous(),
                    qkv.w, qkv.scale, qkv.corr, _NO_BIAS if qkv.bias is None else qkv.bias,
                    o.w, o.scale, o.corr,
                    layer.post_attention_layernorm.weight.detach().contiguous(),
                    gate_up.w, gate_up.scale, gate_up.corr,
                    down.w, down.scale, down.corr]
    native = ext.DecodeStack(tensors, q.hidden_size, q.num_attention_heads, q.num_key_value_heads, q.head_dim,
                             q.intermediate_size, float(llm.qwen.layers[0].input_layernorm.eps))
    stack = _with_head(FusedDecodeStack(native), llm)
    log.info("int8 decode steps of 1..%d rows run fused (one native call per step)", stack.max_rows)
    return stack


def _with_head(stack: FusedDecodeStack, llm: SpeechLM) -> FusedDecodeStack:
    """Bind the final norm and the speech head where the stack can run them (an int8 head packed for the kernel
    on an int8 stack; an fp32 or bf16 head in its (out, in) rows on a stack of its kind); else the step leaves
    them to torch."""
    native, head, norm = stack._native, llm.llm_decoder, llm.qwen.norm
    if norm.weight.dtype != torch.float32:
        return stack
    dense = {"F32DecodeStack": torch.float32, "BF16DecodeStack": torch.bfloat16}.get(type(native).__name__)
    if dense is None and isinstance(head, Int8Linear):
        pk = head.packed
        tensors = [pk.w, pk.scale, pk.corr, _NO_BIAS if pk.bias is None else pk.bias]
    elif (dense is not None and type(head) in (nn.Linear, CastLinear) and head.weight.dtype == dense
          and head.weight.is_contiguous()):
        tensors = [head.weight.detach(), _NO_BIAS if head.bias is None else head.bias.detach().float().contiguous()]
    else:
        return stack
    native.set_head(norm.weight.detach().contiguous(), tensors, head.out_features,  # type: ignore[attr-defined]
                    float(norm.eps))
    stack.has_head = True
    return stack


def _kind(packed: Sequence[PackedLayer | None]) -> str:
    """The packed layers' weight kind: "fp32" or "bf16" when every layer holds such dense weights, else "int8"
    (whether the int8 step applies is `_unsupported`'s question)."""
    dtypes = {pk.qkv_t.dtype if isinstance(pk.qkv_t, torch.Tensor) else None for pk in packed if pk is not None}
    if packed and all(pk is not None for pk in packed) and len(dtypes) == 1:
        return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtypes.pop(), "int8")
    return "int8"


def _dense_stack(llm: SpeechLM, packed: Sequence[PackedLayer | None], ext: object, kind: str) -> FusedDecodeStack:
    """fp32 or bf16 layers: norm1, qkv (Dq + 2 Dkv, D) + bias (fp32), o (D, Dq), norm2, gate_up (2 I, D),
    down (D, I), all (out, in) row-major, read from `packed_weights`' storage (the per-op path reads the same
    tensors: no copy)."""
    q = llm.config.qwen
    tensors: list[torch.Tensor] = []
    for layer, pk in zip(llm.qwen.layers, packed):
        assert pk is not None and isinstance(pk.qkv_t, torch.Tensor) and isinstance(pk.gate_up_t, torch.Tensor)
        assert isinstance(pk.o_t, torch.Tensor) and isinstance(pk.down_t, torch.Tensor)
        # .t() undoes the packed (in, out) views; contiguous() is a no-op on packed_weights' layout and copies
        # only where a weight arrived otherwise laid out
        tensors += [layer.input_layernorm.weight.detach().contiguous(),
                    pk.qkv_t.t().contiguous(),  # (Dq + 2 Dkv, D)
                    _NO_BIAS if pk.qkv_bias is None else pk.qkv_bias.float().contiguous(),
                    pk.o_t.t().contiguous(),  # (D, Dq): the module's storage
                    layer.post_attention_layernorm.weight.detach().contiguous(),
                    pk.gate_up_t.t().contiguous(),  # (2 I, D)
                    pk.down_t.t().contiguous()]  # (D, I): the module's storage
    stack = ext.F32DecodeStack if kind == "fp32" else ext.BF16DecodeStack  # type: ignore[attr-defined]
    native = stack(tensors, q.hidden_size, q.num_attention_heads, q.num_key_value_heads, q.head_dim,
                   q.intermediate_size, float(llm.qwen.layers[0].input_layernorm.eps))
    fused = FusedDecodeStack(native)
    log.info("%s decode steps of 1..%d rows run fused (one native call per step)", kind, fused.max_rows)
    return fused


def _unsupported(llm: SpeechLM, packed: Sequence[PackedLayer | None], cache_dtype: torch.dtype,
                 kind: str) -> str | None:
    dense = kind != "int8"  # fp32 or bf16: what the fp32 step needs, the bf16 one needs too
    if not dense and (not packed or any(pk is None or not isinstance(pk.qkv_t, Int8Weight) for pk in packed)):
        return "not every layer is int8-, fp32- or bf16-packed"
    q = llm.config.qwen
    if cache_dtype != torch.float32 or llm.speech_embedding.weight.device.type != "cpu":
        return "cache not fp32 on CPU"
    if q.head_dim % 16 or q.intermediate_size % int8_gemv.PANEL:
        return "head_dim not a multiple of 16 or intermediate size not whole panels"
    if dense and ((q.num_attention_heads * q.head_dim) % int8_gemv.PANEL
                 or (q.num_key_value_heads * q.head_dim) % int8_gemv.PANEL):
        return "q or k/v width not whole 64-channel panels"
    layers = llm.qwen.layers
    eps = {float(layer.input_layernorm.eps) for layer in layers} | {float(layer.post_attention_layernorm.eps)
                                                                    for layer in layers}
    if len(eps) != 1 or any(layer.input_layernorm.weight.dtype != torch.float32 for layer in layers):
        return "norms not uniform fp32"
    # last: for dense weights this may build the extension (once per machine), only where the step would apply.
    # The dense steps need the extension only, not the int8 kernel's VNNI
    reason = int8_gemv.fp32_unavailable_reason() if dense else int8_gemv.unavailable_reason()
    if reason is not None:
        return f"native kernels unavailable ({reason})"
    return None
