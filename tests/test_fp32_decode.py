"""The fused fp32 decode step (int8_decode's `F32DecodeStack`: the whole decoder stack of a 1..4-row decode step
in one native call over fp32 weights) against the engine's per-op fp32 path and the modules' own generate.

Bounds: log-probs within 1e-4 absolute of the per-op path's at every step (only fp32 summation order differs;
measured ~1e-6), the same greedy tokens as the per-op path and as `Qwen2LM.generate` (the module path); a schedule
where every waiting thread recomputes items still held by another gives the same values bit for bit. Skips where
the kernel extension cannot be built (CPU without AVX-512 VNNI, no compiler).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vocalis.config import PRESETS
from vocalis.engine import int8_gemv
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.engine.model_runner import StepInputs
from vocalis.engine.request import SamplingParams
from vocalis.models.speech_lm import Qwen2LM
from vocalis.sampling import make_greedy_sampler

kernel = pytest.mark.skipif(not int8_gemv.available(),
                            reason=f"kernel extension unavailable: {int8_gemv.unavailable_reason()}")

TEXTS = [[40, 41, 42], [50, 51, 52, 53, 54], [60], [70, 71], [80, 81, 82, 83, 84, 85, 86], [90]]


def _lm(hidden: int, heads: int, kv_heads: int, intermediate: int) -> Qwen2LM:
    cfg = PRESETS["tiny"].llm
    cfg = dataclasses.replace(cfg, qwen=dataclasses.replace(
        cfg.qwen, hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
        num_key_value_heads=kv_heads))
    torch.manual_seed(0)
    return Qwen2LM(cfg).eval().requires_grad_(False)


def _engine(lm: Qwen2LM) -> LLMEngine:
    return LLMEngine(lm, EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=128))


def _run(lm: Qwen2LM, texts: list[list[int]], fused: bool, max_rows: int = 4, grace_ns: int | None = None
         ) -> tuple[list[list[int]], list[tuple[bool, torch.Tensor]]]:
    """Greedy tokens per request and (step ran fused, log-probs) per step."""
    eng = _engine(lm)
    stack = eng.runner.fused_decode
    assert stack is not None and type(stack._native).__name__ == "F32DecodeStack"
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


@kernel
@pytest.mark.parametrize(("hidden", "heads", "kv_heads", "intermediate"),
                         [(128, 4, 2, 256), (192, 3, 1, 320)])  # G 2 / 3, odd panel counts
@pytest.mark.parametrize("num_requests", [1, 4, 6])
def test_fused_fp32_step_equals_per_op_path(hidden: int, heads: int, kv_heads: int, intermediate: int,
                                            num_requests: int) -> None:
    """Same engine steps with and without the fused stack: log-probs within 1e-4, same greedy tokens. Row tiles
    of 1..6 (6 by raising max_rows to the kernel's limit), paged contexts of different lengths, mixed prefill +
    decode steps (those take the per-op path in both)."""
    lm = _lm(hidden, heads, kv_heads, intermediate)
    texts = TEXTS[:num_requests]
    tokens, steps = _run(lm, texts, fused=True, max_rows=6)
    want_tokens, want_steps = _run(lm, texts, fused=False)
    assert tokens == want_tokens
    assert len(steps) == len(want_steps) and sum(f for f, _ in steps) >= 8  # most steps ran fused
    for (_, y), (_, want) in zip(steps, want_steps):
        assert y.shape == want.shape
        assert float((y - want).abs().max()) <= 1e-4


@kernel
@pytest.mark.parametrize("num_requests", [1, 4])
def test_fused_fp32_engine_equals_module_generate(num_requests: int) -> None:
    """The engine (decode steps fused) gives the modules' greedy tokens, one request at a time, over 8-12 steps."""
    lm = _lm(128, 4, 2, 256)
    eng = _engine(lm)
    assert eng.runner.fused_decode is not None
    texts = TEXTS[:num_requests]
    reqs = [eng.make_request(t, params=SamplingParams(greedy=True, min_len=8, max_len=12)) for t in texts]
    got = eng.generate(reqs)
    for text, req in zip(texts, reqs):
        want = list(lm.generate(text, [], [], min_len=8, max_len=12, sample_fn=make_greedy_sampler()))
        assert got[req.request_id] == want


@kernel
def test_fused_fp32_duplicated_items_change_nothing() -> None:
    """Grace 0: a thread out of work at once recomputes items another thread still holds; same values bit for bit."""
    lm = _lm(128, 4, 2, 256)
    texts = TEXTS[:3]
    tokens, steps = _run(lm, texts, fused=True, grace_ns=0)
    want_tokens, want_steps = _run(lm, texts, fused=True)
    assert tokens == want_tokens
    for (_, y), (_, want) in zip(steps, want_steps):
        assert torch.equal(y, want)


def test_fused_fp32_off_by_env_or_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """VOCALIS_FP32_FUSED=0, or q / k-v widths that are not whole 64-channel panels: the per-op path only."""
    assert _engine(_lm(64, 4, 2, 128)).runner.fused_decode is None  # k/v width 32
    monkeypatch.setenv("VOCALIS_FP32_FUSED", "0")
    eng = _engine(_lm(128, 4, 2, 256))
    assert eng.runner.fused_decode is None and all(p is not None for p in eng.runner.packed)
