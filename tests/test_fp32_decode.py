"""The fused fp32 decode step (int8_decode's `F32DecodeStack`: the whole decoder stack of a 1..4-row decode step
in one native call over fp32 weights) against the engine's per-op fp32 path and the modules' own generate.

Bounds: log-probs within 1e-4 absolute of the per-op path's at every step (only fp32 summation order differs;
measured ~1e-6), the same greedy tokens as the per-op path and as `Qwen2LM.generate` (the module path); a schedule
where every waiting thread recomputes items still held by another gives the same values bit for bit. Skips where
the kernel extension cannot be built (CPU without AVX2 or AVX-512, no compiler).
"""

from __future__ import annotations

import pytest
import torch

from tests.fused_decode_support import (
    TEXTS,
    check_duplicated_items_change_nothing,
    check_fused_equals_per_op,
    dense_kernel,
    small_engine,
    tiny_lm,
)
from vocalis.engine.request import SamplingParams
from vocalis.kernels import cpu
from vocalis.precision import int8_linear as int8_gemv
from vocalis.reference.decode import generate
from vocalis.reference.sampling import make_greedy_sampler

kernel = dense_kernel


@kernel
@pytest.mark.parametrize(("hidden", "heads", "kv_heads", "intermediate"),
                         [(128, 4, 2, 256), (192, 3, 1, 320)])  # G 2 / 3, odd panel counts
@pytest.mark.parametrize("num_requests", [1, 4, 6, 16])
def test_fused_fp32_step_equals_per_op_path(hidden: int, heads: int, kv_heads: int, intermediate: int,
                                            num_requests: int) -> None:
    check_fused_equals_per_op(tiny_lm(hidden, heads, kv_heads, intermediate), num_requests, native="F32DecodeStack",
                              head=True)


@kernel
@pytest.mark.parametrize("num_requests", [1, 4])
def test_fused_fp32_engine_equals_module_generate(num_requests: int) -> None:
    """The engine (decode steps fused) gives the modules' greedy tokens, one request at a time, over 8-12 steps."""
    lm = tiny_lm(128, 4, 2, 256)
    eng = small_engine(lm)
    assert eng.runner.fused_decode is not None
    texts = TEXTS[:num_requests]
    reqs = [eng.make_request(t, params=SamplingParams(greedy=True, min_len=8, max_len=12)) for t in texts]
    got = eng.generate(reqs)
    for text, req in zip(texts, reqs):
        want = list(generate(lm, text, [], [], min_len=8, max_len=12, sample_fn=make_greedy_sampler()))
        assert got[req.request_id] == want


@kernel
def test_fused_fp32_duplicated_items_change_nothing() -> None:
    check_duplicated_items_change_nothing(tiny_lm(128, 4, 2, 256))


def test_fused_fp32_off_by_env_or_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """VOCALIS_FP32_FUSED=0, or q / k-v widths that are not whole 64-channel panels: the per-op path only."""
    assert small_engine(tiny_lm(64, 4, 2, 128)).runner.fused_decode is None  # k/v width 32
    monkeypatch.setenv("VOCALIS_FP32_FUSED", "0")
    eng = small_engine(tiny_lm(128, 4, 2, 256))
    assert eng.runner.fused_decode is None and all(p is not None for p in eng.runner.packed)


@kernel
def test_fused_fp32_reads_the_packed_storage() -> None:
    """One weight layout for both paths: every fp32 weight the fused step reads is already (out, in) contiguous in
    `packed_weights`' storage (so `_fp32_stack` takes it without a copy), the modules' weights are views into it."""
    lm = tiny_lm(128, 4, 2, 256)
    eng = small_engine(lm)
    assert eng.runner.fused_decode is not None and eng.runner.fused_decode.has_head
    assert lm.llm_decoder.weight.is_contiguous()
    for layer, pk in zip(lm.qwen.layers, eng.runner.packed):
        assert pk is not None
        for w_t in (pk.qkv_t, pk.gate_up_t, pk.o_t, pk.down_t):
            assert isinstance(w_t, torch.Tensor) and w_t.t().is_contiguous()
        assert layer.self_attn.v_proj.weight.data_ptr() == pk.qkv_t.data_ptr() + 4 * (pk.q_dim + pk.kv_dim) * 128
        assert layer.mlp.up_proj.weight.data_ptr() == pk.gate_up_t.data_ptr() + 4 * 256 * 128


@kernel
@pytest.mark.skipif(not cpu.features().avx512, reason="forcing the AVX-512 level needs an AVX-512 CPU")
def test_fused_fp32_step_needs_no_vnni(force_cpu_level) -> None:
    """At the AVX-512 level without VNNI (forced): the int8 kernel is off, the fp32 fused step still runs."""
    force_cpu_level("avx512")
    assert not int8_gemv.available() and int8_gemv.fp32_unavailable_reason() is None
    assert small_engine(tiny_lm(128, 4, 2, 256)).runner.fused_decode is not None
