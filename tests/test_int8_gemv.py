"""The int8 kernels (vocalis/precision/int8_linear.py) against a float64 reference of the same quantized math, their
fusion, their use by the LLM engine, and the fallback when they cannot be built.

Bounds: kernel vs reference max abs <= 1e-5 * max |y| (the only differences are fp32 rounding in the scale-out:
measured ~1e-7); fused == separate and batched == one row at a time bit for bit (per-row activation scales and
exact int32 sums make every row's result independent of the others); the engine's greedy tokens equal the
reference path's with the same int8 layers. The fused decode step (int8_decode: the whole layer stack in one native
call for 1..4 single-query rows) gives the per-op int8 path's log-probs within 1e-4 absolute (measured <= 1e-6:
only fp32 summation order and a polynomial exp differ) and the same greedy tokens. Kernel tests run the kernel of
the machine's level (VNNI on AVX-512 VNNI CPUs, int8_gemv_avx2.cpp on AVX2 ones; the AVX2 one also forced on
bigger CPUs) and skip where none is available (AVX-512 without VNNI, no AVX2, no compiler); the fallback test
runs everywhere.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tests.fused_decode_support import check_duplicated_items_change_nothing, check_fused_equals_per_op, tiny_lm
from vocalis.config import PRESETS
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.engine.request import SamplingParams
from vocalis.kernels import cpu
from vocalis.kernels.config import INT8_GRAIN_BYTES
from vocalis.models.speech_lm import Qwen2LM
from vocalis.precision import int8_linear as int8_gemv
from vocalis.precision.int8_linear import (
    Int8Linear,
    fuse,
    int8_linear,
    int8_linear_reference,
    int8_linears,
    quantize_weight,
)
from vocalis.reference.decode import generate
from vocalis.reference.sampling import make_greedy_sampler

kernel = pytest.mark.skipif(not int8_gemv.available(),
                            reason=f"int8 kernel unavailable: {int8_gemv.unavailable_reason()}")


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert float((y - ref).abs().max()) <= 1e-5 * float(ref.abs().max()) + 1e-12


@kernel
@pytest.mark.parametrize(("n", "k"), [(128, 64), (70, 10), (200, 4864 // 8), (6564 // 16, 96)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("split", [False, True])
def test_kernel_equals_quantized_reference(n: int, k: int, bias: bool, split: bool) -> None:
    g = torch.Generator().manual_seed(n + k)
    # split: every panel its own share of the thread pool (the default grain runs these small weights on one)
    w = quantize_weight(torch.randn(n, k, generator=g), torch.randn(n, generator=g) if bias else None,
                        grain_bytes=0 if split else INT8_GRAIN_BYTES)
    for m in (1, 2, 5, 7, 16, 23):
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
        _close(int8_linear(x, w), int8_linear_reference(x, w))


@kernel
def test_rows_are_independent_and_zero_rows_give_bias() -> None:
    g = torch.Generator().manual_seed(0)
    w = quantize_weight(torch.randn(96, 40, generator=g), torch.randn(96, generator=g))
    x = torch.randn(11, 40, generator=g)
    x[3] = 0
    y = int8_linear(x, w)
    for i in range(11):
        assert torch.equal(y[i:i + 1], int8_linear(x[i:i + 1], w))  # batched == one at a time, bit for bit
    assert w.bias is not None
    torch.testing.assert_close(y[3], w.bias[:96], atol=0, rtol=0)


@kernel
def test_fused_equals_parts() -> None:
    g = torch.Generator().manual_seed(1)
    parts = [quantize_weight(torch.randn(n, 48, generator=g), torch.randn(n, generator=g)) for n in (128, 64, 64)]
    x = torch.randn(3, 48, generator=g)
    separate = [int8_linear(x, p) for p in parts]
    fused = fuse(parts)
    assert fused is not None
    whole, views = fused
    assert torch.equal(int8_linear(x, whole), torch.cat(separate, dim=1))
    for view, want in zip(views, separate):
        assert torch.equal(int8_linear(x, view), want)
    assert fuse([quantize_weight(torch.randn(70, 48)), parts[0]]) is None  # 70 is not whole panels


@kernel
def test_int8_linear_module_close_to_float() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 96)
    mod = Int8Linear(lin)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        y, want = mod(x), lin(x)
    assert y.shape == (2, 5, 96)
    assert float((y - want).abs().max()) <= 0.03 * float(want.abs().max())  # measured ~0.01


@kernel
def test_int8_engine_equals_reference_path() -> None:
    """The engine's fused int8 GEMMs (batched, paged) give the modules' greedy tokens one request at a time.
    Shapes whose q, k, v and gate, up are whole 64-channel panels, so the fused path is the one tested."""
    cfg = PRESETS["tiny"].llm
    cfg = dataclasses.replace(cfg, qwen=dataclasses.replace(cfg.qwen, hidden_size=128, intermediate_size=256))
    torch.manual_seed(0)
    lm = Qwen2LM(cfg).eval().requires_grad_(False)
    assert int8_linears(lm) == 7 * cfg.qwen.num_hidden_layers + 1
    eng = LLMEngine(lm, EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=128))
    assert all(p is not None for p in eng.runner.packed)  # fused
    assert eng.runner.fused_decode is not None  # decode steps of <= 4 rows run the native stack
    texts = [[40, 41, 42], [50, 51, 52, 53, 54], [60]]
    reqs = [eng.make_request(t, params=SamplingParams(greedy=True, min_len=4, max_len=10)) for t in texts]
    got = eng.generate(reqs)
    for text, req in zip(texts, reqs):
        want = list(generate(lm, text, [], [], min_len=4, max_len=10, sample_fn=make_greedy_sampler()))
        assert got[req.request_id] == want


def test_fallback_when_the_kernel_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """No kernel: the int8 backend quantizes the LLM with torch's dynamic quantization and says so."""
    from vocalis.backends.choice import apply_backend
    from vocalis.kernels import build
    from vocalis.model_dir import random_model

    monkeypatch.setattr(build, "_ext", None)
    monkeypatch.setattr(build, "_reason", "test: pretend the kernels cannot be built")
    model = random_model()
    runtime = apply_backend(model, "torch", "int8")
    assert any("fbgemm" in note for note in runtime.notes), runtime.notes
    assert not any(isinstance(m, Int8Linear) for m in model.llm.modules())
    assert type(model.llm.llm_decoder).__name__ == "Linear" and "quantized" in type(model.llm.llm_decoder).__module__
    # the engine runs them as modules: packing leaves layers it cannot fuse alone (their `weight` is a method)
    engine = LLMEngine(model.llm, EngineConfig(num_kv_blocks=64))
    assert all(pk is None for pk in engine.runner.packed)


def _int8_lm(hidden: int, heads: int, kv_heads: int, intermediate: int) -> Qwen2LM:
    lm = tiny_lm(hidden, heads, kv_heads, intermediate)
    int8_linears(lm)
    return lm


@kernel
@pytest.mark.parametrize(("hidden", "heads", "kv_heads", "intermediate"),
                         [(128, 4, 2, 256), (256, 4, 1, 192), (192, 3, 1, 320)])  # G 2 / 4 / 3, odd panel counts
@pytest.mark.parametrize("num_requests", [1, 4, 6, 16])
def test_fused_decode_step_equals_per_op_path(hidden: int, heads: int, kv_heads: int, intermediate: int,
                                              num_requests: int) -> None:
    check_fused_equals_per_op(_int8_lm(hidden, heads, kv_heads, intermediate), num_requests, head=True)


@kernel
def test_fused_decode_duplicated_items_change_nothing() -> None:
    check_duplicated_items_change_nothing(_int8_lm(128, 4, 2, 256))


@kernel
def test_fused_decode_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VOCALIS_INT8_FUSED", "0")
    lm = _int8_lm(128, 4, 2, 256)
    eng = LLMEngine(lm, EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=128))
    assert eng.runner.fused_decode is None and all(p is not None for p in eng.runner.packed)


@pytest.mark.skipif(not cpu.features().avx2, reason="no AVX2 on this CPU")
def test_avx2_kernel_as_on_an_avx2_cpu(force_cpu_level) -> None:
    """The AVX2 source set (int8_gemv_avx2.cpp, decode_math_avx2.cpp), as an AVX2-only CPU runs it, also where the
    CPU has more (forced by VOCALIS_CPU_ISA): its own weight order, the same math as the reference, the fused
    decode step equal to the per-op path; a weight packed for the other kernel is refused."""
    force_cpu_level("avx2")
    ext = int8_gemv.extension()
    if ext is None:
        pytest.skip(f"native kernels unavailable: {int8_gemv.unavailable_reason()}")
    assert ext.isa == "avx2" and int8_gemv.available() and int8_gemv.layout() == "avx2"
    g = torch.Generator().manual_seed(5)
    for n, k in ((200, 4864 // 8), (70, 10)):
        dense = torch.randn(n, k, generator=g)
        w = quantize_weight(dense, torch.randn(n, generator=g))
        assert w.layout == "avx2"  # the same int8 values as the VNNI order, only placed differently
        assert torch.equal(int8_gemv._unpack(w), int8_gemv._unpack(quantize_weight(dense, order="avx512")))
        assert not torch.equal(w.w, quantize_weight(dense, order="avx512").w)
        for m in (1, 3, 4, 9):
            x = torch.randn(m, k, generator=g) * 3
            _close(int8_linear(x, w), int8_linear_reference(x, w))
    other = quantize_weight(torch.randn(64, 32, generator=g), order="avx512")
    with pytest.raises(AssertionError, match="packed for the avx512 kernel"):
        int8_linear(torch.randn(1, 32), other)
    check_fused_equals_per_op(_int8_lm(128, 4, 2, 256), 4, head=True)
