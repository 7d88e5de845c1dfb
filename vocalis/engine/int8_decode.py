"""The int8 LLM's decoder stack for decode steps of a few rows as one native call (int8_decode.cpp).

Why: with the VNNI kernel reading weights as fast as a copy, a batch-1 int8 decode step still spent ~7 ms of
~25 ms outside the GEMVs, in ~20 small torch ops per layer x 24 layers (RMSNorm, rotary, K/V writes, gathering
the context, SDPA, residual adds, SiLU * mul, quantising activations per GEMV, one thread-pool wake per op).
`Int8DecodeStack` runs every layer of a step (1..`max_rows` single-query rows, no prefill chunk) inside one
OpenMP parallel region: the threads split each GEMV by 64-channel panels (so the small q/k/v and o projections,
which `int8_linear` runs on one thread, use every thread too) and meet at 5 barriers per layer.

Same math as `ModelRunner.forward`'s int8 path (the same packed weights, per-row int8 activations, exact int32
sums); fp32 rounding differs (summation order in RMSNorm and attention, a polynomial exp), so an activation
rounding to int8 may flip by one step: outputs agree to ~1e-3 of their scale, not bit for bit (see the tests).

Used by `ModelRunner` when the kernel is built, every layer's weights are int8-packed (`packed_weights`), the
cache is fp32 and head_dim a multiple of 16; `VOCALIS_INT8_FUSED=0` turns it off (the per-op path remains for
prefill, larger batches and every other precision).

Legend: M rows, D hidden, L layers, S cache slots, Hkv key/value heads, Dh head width, Lmax context length.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from vocalis.engine import int8_gemv
from vocalis.engine.int8_gemv import Int8Weight
from vocalis.engine.packed_weights import PackedLayer
from vocalis.models.speech_lm import Qwen2LM

log = logging.getLogger(__name__)

# rows up to which a decode step runs fused: at 1..4 rows the step is weight-read bound and per-op overhead is
# a large share; the kernel's row tile allows up to 6
MAX_ROWS = 4
_NO_BIAS = torch.empty(0)


class Int8DecodeStack:
    """A native handle on one LLM's int8 decoder layers (it holds references to the packed weights)."""

    def __init__(self, native: object, max_rows: int) -> None:
        self._native = native
        self.max_rows = max_rows

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

    def set_grace_ns(self, ns: int) -> None:
        """How long a thread out of work waits for a claimed item before computing it too (0: at once, which
        tests use to exercise the duplicate path; default 200 us)."""
        self._native.set_grace_ns(ns)  # type: ignore[attr-defined]


def decode_stack(llm: Qwen2LM, packed: Sequence[PackedLayer | None],
                 cache_dtype: torch.dtype) -> Int8DecodeStack | None:
    """The fused stack for `llm`, or None where it does not apply (see the module doc; logged at debug)."""
    reason = _unsupported(llm, packed, cache_dtype)
    if reason is not None:
        log.debug("fused int8 decode step off: %s", reason)
        return None
    ext = int8_gemv.extension()
    assert ext is not None
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
    log.info("int8 decode steps of 1..%d rows run fused (one native call per step)", MAX_ROWS)
    return Int8DecodeStack(native, MAX_ROWS)


def _unsupported(llm: Qwen2LM, packed: Sequence[PackedLayer | None], cache_dtype: torch.dtype) -> str | None:
    if os.environ.get("VOCALIS_INT8_FUSED", "1") == "0":
        return "VOCALIS_INT8_FUSED=0"
    if not packed or any(pk is None or not isinstance(pk.qkv_t, Int8Weight) for pk in packed):
        return "not every layer is int8-packed"
    if not int8_gemv.available() or not hasattr(int8_gemv.extension(), "DecodeStack"):
        return f"kernel unavailable ({int8_gemv.unavailable_reason()})"
    q = llm.config.qwen
    if cache_dtype != torch.float32 or llm.speech_embedding.weight.device.type != "cpu":
        return "cache not fp32 on CPU"
    if q.head_dim % 16 or q.intermediate_size % int8_gemv.PANEL:
        return "head_dim not a multiple of 16 or intermediate size not whole panels"
    layers = llm.qwen.layers
    eps = {float(layer.input_layernorm.eps) for layer in layers} | {float(layer.post_attention_layernorm.eps)
                                                                    for layer in layers}
    if len(eps) != 1 or any(layer.input_layernorm.weight.dtype != torch.float32 for layer in layers):
        return "norms not uniform fp32"
    return None
