"""Shared by the fused decode step tests (int8, fp32, bf16): run an engine with or without its fused stack and
record every step's log-probs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vocalis.config import PRESETS
from vocalis.precision import int8_linear as int8_gemv
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.engine.model_runner import StepInputs
from vocalis.engine.request import SamplingParams
from vocalis.models.speech_lm import Qwen2LM

# the fp32 and bf16 steps need the kernel extension only (AVX-512, a compiler), not the int8 kernel's VNNI
dense_kernel = pytest.mark.skipif(int8_gemv.fp32_unavailable_reason() is not None,
                                  reason=f"kernel extension unavailable: {int8_gemv.fp32_unavailable_reason()}")

# requests of different lengths: paged contexts that end mid-block, mixed prefill + decode steps
TEXTS = [[40, 41, 42], [50, 51, 52, 53, 54], [60], [70, 71], [80, 81, 82, 83, 84, 85, 86], [90],
         *([100 + 10 * i + j for j in range(1 + i % 5)] for i in range(10))]  # 16 in all: tiles of rows


def tiny_lm(hidden: int, heads: int, kv_heads: int, intermediate: int) -> Qwen2LM:
    """The tiny preset's LM with these widths (seed 0), eval mode, no gradients."""
    cfg = PRESETS["tiny"].llm
    cfg = dataclasses.replace(cfg, qwen=dataclasses.replace(
        cfg.qwen, hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
        num_key_value_heads=kv_heads))
    torch.manual_seed(0)
    return Qwen2LM(cfg).eval().requires_grad_(False)


def small_engine(lm: Qwen2LM) -> LLMEngine:
    return LLMEngine(lm, EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=128))


def run_steps(lm: Qwen2LM, texts: list[list[int]], fused: bool, max_rows: int | None = 4, grace_ns: int | None = None,
              native: str | None = None, head: bool | None = None
              ) -> tuple[list[list[int]], list[tuple[bool, torch.Tensor]]]:
    """Greedy tokens per request and (step ran fused, log-probs) per step. `native`: the expected class name of
    the fused stack's native object; `head`: whether the stack is expected to run the final norm and head too;
    `max_rows` None: the native kernel's own limit (16 rows, in tiles of 6 (AVX-512) or 4 (AVX2))."""
    eng = small_engine(lm)
    stack = eng.runner.fused_decode
    assert stack is not None
    if native is not None:
        assert type(stack._native).__name__ == native
    if head is not None:
        assert stack.has_head == head
    if max_rows is None:
        max_rows = int(stack._native.max_rows())  # type: ignore[attr-defined]
    stack.max_rows = max_rows
    if grace_ns is not None:
        stack.set_grace_ns(grace_ns)
    if not fused:
        eng.runner.fused_decode = None
    steps: list[tuple[bool, torch.Tensor]] = []
    forward = eng.runner.forward

    def recorded(inp: StepInputs) -> torch.Tensor:
        y = forward(inp)
        steps.append((fused and not inp.prefills and inp.ids.shape[0] <= max_rows, y.clone()))
        return y

    eng.runner.forward = recorded  # type: ignore[method-assign]
    reqs = [eng.make_request(t, params=SamplingParams(greedy=True, min_len=8, max_len=12)) for t in texts]
    got = eng.generate(reqs)
    return [got[r.request_id] for r in reqs], steps


def check_fused_equals_per_op(lm: Qwen2LM, num_requests: int, native: str | None = None,
                              head: bool | None = None, bound: float = 1e-4) -> None:
    """Same engine steps with and without the fused stack: log-probs within `bound`, same greedy tokens. Row tiles
    up to the kernel's limit (raising max_rows to it), paged contexts of different lengths, mixed prefill +
    decode steps (those take the per-op path in both)."""
    texts = TEXTS[:num_requests]
    limit = int(small_engine(lm).runner.fused_decode._native.max_rows())  # type: ignore[union-attr]
    if num_requests > limit:  # every decode step has more rows than the kernel takes: nothing would run fused
        pytest.skip(f"{num_requests} rows: more than this kernel's {limit}")
    tokens, steps = run_steps(lm, texts, fused=True, max_rows=None, native=native, head=head)
    want_tokens, want_steps = run_steps(lm, texts, fused=False)
    assert tokens == want_tokens
    assert len(steps) == len(want_steps) and sum(f for f, _ in steps) >= 8  # most steps ran fused
    for (_, y), (_, want) in zip(steps, want_steps):
        assert y.shape == want.shape
        assert float((y - want).abs().max()) <= bound


def check_duplicated_items_change_nothing(lm: Qwen2LM) -> None:
    """Grace 0: a thread out of work at once recomputes items another thread still holds (the path that covers a
    thread losing its core); the results are those of the normal schedule, bit for bit."""
    texts = TEXTS[:3]
    tokens, steps = run_steps(lm, texts, fused=True, grace_ns=0)
    want_tokens, want_steps = run_steps(lm, texts, fused=True)
    assert tokens == want_tokens
    for (_, y), (_, want) in zip(steps, want_steps):
        assert torch.equal(y, want)
