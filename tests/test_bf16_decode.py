"""The fused bf16 decode step (int8_decode's `BF16DecodeStack`: the decoder stack of a 1..16-row decode step in one
native call over the bf16 backend's weights) against the engine's per-op bf16 path and against fp32.

Bounds (tiny LMs, random weights): log-probs within 2e-2 absolute of the per-op bf16 path's at every step [measured
~1e-2: the per-op path rounds every Linear's output to bf16, the fused step keeps fp32 sums] with the same greedy
tokens; within 5e-2 of the fp32 fused step's [~1.1e-2]; a schedule where waiting threads recompute items still held
by another changes nothing, bit for bit. Skips where the kernel extension cannot be built.
"""

from __future__ import annotations

import pytest
import torch

from tests.fused_decode_support import (
    TEXTS,
    check_duplicated_items_change_nothing,
    check_fused_equals_per_op,
    dense_kernel,
    run_steps,
    small_engine,
    tiny_lm,
)
from vocalis.precision.layers import cast_linears

kernel = dense_kernel


def _bf16_lm(hidden: int, heads: int, kv_heads: int, intermediate: int):
    lm = tiny_lm(hidden, heads, kv_heads, intermediate)
    cast_linears(lm, torch.bfloat16)  # as the bf16 backend does: every Linear a CastLinear, the head included
    return lm


@kernel
@pytest.mark.parametrize(("hidden", "heads", "kv_heads", "intermediate"),
                         [(128, 4, 2, 256), (192, 3, 1, 320)])  # G 2 / 3, odd panel counts
@pytest.mark.parametrize("num_requests", [1, 4, 6])  # 16 rows: against fp32 below (bf16 log-prob ties flip tokens)
def test_fused_bf16_step_equals_per_op_path(hidden: int, heads: int, kv_heads: int, intermediate: int,
                                            num_requests: int) -> None:
    check_fused_equals_per_op(_bf16_lm(hidden, heads, kv_heads, intermediate), num_requests,
                              native="BF16DecodeStack", head=True, bound=2e-2)


@kernel
@pytest.mark.parametrize("num_requests", [4, 16])
def test_fused_bf16_step_against_fp32(num_requests: int) -> None:
    """The precision's own error: the bf16 fused step's log-probs against the fp32 fused step's (16 requests: steps
    of up to 16 rows, in row tiles)."""
    texts = TEXTS[:num_requests]
    tokens, steps = run_steps(_bf16_lm(128, 4, 2, 256), texts, fused=True, native="BF16DecodeStack", max_rows=None)
    ref_tokens, ref_steps = run_steps(tiny_lm(128, 4, 2, 256), texts, fused=True, native="F32DecodeStack",
                                      max_rows=None)
    assert sum(f for f, _ in steps) >= 8 and len(steps) == len(ref_steps)
    err = max(float((y - want).abs().max()) for (_, y), (_, want) in zip(steps, ref_steps))
    agree = sum(a == b for t, r in zip(tokens, ref_tokens) for a, b in zip(t, r)) / sum(len(r) for r in ref_tokens)
    print("bf16 fused vs fp32: log-prob max abs", err, "token agreement", agree)
    assert 0 < err <= 5e-2
    assert agree >= 0.9


@kernel
def test_fused_bf16_duplicated_items_change_nothing() -> None:
    check_duplicated_items_change_nothing(_bf16_lm(128, 4, 2, 256))


def test_fused_bf16_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VOCALIS_BF16_FUSED", "0")
    assert small_engine(_bf16_lm(128, 4, 2, 256)).runner.fused_decode is None
