"""The engine's and the kernels' switches are config fields: the environment maps onto them in one function each
(`EngineConfig.with_env_overrides`, `KernelConfig.with_env_overrides`), and a field turned off changes which path
runs, not the results."""

from __future__ import annotations

import pytest
import torch

from tests.fused_decode_support import TEXTS, dense_kernel, tiny_lm
from vocalis.backends.choice import apply_backend
from vocalis.engine.config import FUSED_DECODE_KINDS, EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.engine.model_runner import StepInputs
from vocalis.engine.request import SamplingParams
from vocalis.kernels.config import INT8_GRAIN_BYTES, KernelConfig
from vocalis.model_dir import random_model
from vocalis.precision import int8_linear as int8_gemv
from vocalis.precision.int8_linear import Int8Linear, Int8Weight, int8_linears


def test_env_overrides_map_onto_the_fields() -> None:
    base = EngineConfig(max_num_seqs=3)
    assert base.with_env_overrides({}) == base
    got = base.with_env_overrides({"VOCALIS_FP32_FUSED": "0", "VOCALIS_CUDA_GRAPHS": "0", "VOCALIS_INT8_FUSED": "1",
                                   "VOCALIS_HUGE_PAGES": "0"})
    assert got == EngineConfig(max_num_seqs=3, fused_decode=("int8", "bf16"), cuda_graphs=False, huge_pages=False)
    # a switch only turns a path off: "1" does not bring back what the config left out
    assert EngineConfig(cuda_graphs=False).with_env_overrides({"VOCALIS_CUDA_GRAPHS": "1"}).cuda_graphs is False
    with pytest.raises(ValueError, match="fused_decode"):
        EngineConfig(fused_decode=("fp16",))

    kernels = KernelConfig().with_env_overrides({"VOCALIS_INT8_KERNEL": "0", "VOCALIS_BF16_GEMM": "0",
                                                 "VOCALIS_INT8_GRAIN_BYTES": "4096"})
    assert kernels == KernelConfig(int8_kernel=False, int8_grain_bytes=4096, bf16_gemm=False)
    assert KernelConfig().with_env_overrides({}) == KernelConfig()
    with pytest.raises(ValueError, match="VOCALIS_INT8_GRAIN_BYTES"):
        KernelConfig().with_env_overrides({"VOCALIS_INT8_GRAIN_BYTES": "2M"})


def _greedy_steps(engine: LLMEngine) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy ids per request and every step's log-probs."""
    steps: list[torch.Tensor] = []
    forward = engine.runner.forward

    def recorded(inp: StepInputs) -> torch.Tensor:
        y = forward(inp)
        steps.append(y.clone())
        return y

    engine.runner.forward = recorded  # type: ignore[method-assign]
    reqs = [engine.make_request(t, params=SamplingParams(greedy=True, min_len=8, max_len=12)) for t in TEXTS[:3]]
    got = engine.generate(reqs)
    return [got[r.request_id] for r in reqs], steps


@dense_kernel
def test_fused_decode_left_out_runs_the_per_op_path_with_the_same_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 weights: with "fp32" in `fused_decode` (the default) decode steps run the native stack; left out, by
    the field or by VOCALIS_FP32_FUSED=0, the runner has none and every step runs op by op, to the same ids and
    log-probs within the fused step's rounding."""
    monkeypatch.delenv("VOCALIS_FP32_FUSED", raising=False)
    lm = tiny_lm(128, 4, 2, 256)
    sizes = {"block_size": 4, "max_num_batched_tokens": 16, "num_kv_blocks": 128}
    fused = LLMEngine(lm, EngineConfig(**sizes))
    per_op = LLMEngine(lm, EngineConfig(**sizes, fused_decode=tuple(k for k in FUSED_DECODE_KINDS if k != "fp32")))
    assert fused.runner.fused_decode is not None and per_op.runner.fused_decode is None
    calls = 0
    native_forward = fused.runner.fused_decode.forward_logits

    def counted(*args: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return native_forward(*args)

    fused.runner.fused_decode.forward_logits = counted  # type: ignore[method-assign]
    tokens, steps = _greedy_steps(fused)
    want_tokens, want_steps = _greedy_steps(per_op)
    assert calls >= 8  # most decode steps ran natively
    assert tokens == want_tokens and len(steps) == len(want_steps)
    assert max(float((y - w).abs().max()) for y, w in zip(steps, want_steps)) <= 1e-4

    monkeypatch.setenv("VOCALIS_FP32_FUSED", "0")
    by_env = LLMEngine(lm, EngineConfig(**sizes))
    assert by_env.config.fused_decode == ("int8", "bf16") and by_env.runner.fused_decode is None


def test_int8_kernel_off_falls_back_to_dynamic_quantization() -> None:
    model = random_model()
    runtime = apply_backend(model, "torch", "int8", kernels=KernelConfig(int8_kernel=False))
    assert not runtime.kernels.int8_kernel
    assert any("fbgemm" in note for note in runtime.notes), runtime.notes
    assert not any(isinstance(m, Int8Linear) for m in model.llm.modules())


@pytest.mark.skipif(not int8_gemv.available(), reason=f"int8 kernel unavailable: {int8_gemv.unavailable_reason()}")
def test_int8_grain_reaches_every_weight_the_engine_runs() -> None:
    """The grain `apply_backend` is given lands on every int8 layer, and the engine's fused q/k/v and gate/up
    weights keep it; splitting every GEMV over the threads changes no output (each panel is summed by one thread)."""
    model, default = random_model(), random_model()
    apply_backend(model, "torch", "int8", kernels=KernelConfig(int8_grain_bytes=0))
    apply_backend(default, "torch", "int8")
    layers = [m for m in model.llm.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.packed.grain_bytes == 0 for m in layers)
    assert all(m.packed.grain_bytes == INT8_GRAIN_BYTES for m in default.llm.modules() if isinstance(m, Int8Linear))
    split, whole = model.llm.qwen.layers[0].mlp.down_proj, default.llm.qwen.layers[0].mlp.down_proj
    hidden = torch.randn(3, split.in_features, generator=torch.Generator().manual_seed(1))
    assert torch.equal(split(hidden), whole(hidden))

    lm = tiny_lm(128, 4, 2, 256)  # widths of whole 64-channel panels: the engine fuses them
    int8_linears(lm, grain_bytes=0)
    packed = LLMEngine(lm, EngineConfig(num_kv_blocks=8)).runner.packed
    assert all(isinstance(pk.qkv_t, Int8Weight) and isinstance(pk.gate_up_t, Int8Weight)
               and pk.qkv_t.grain_bytes == pk.gate_up_t.grain_bytes == 0 for pk in packed if pk is not None)
    assert all(pk is not None for pk in packed)
