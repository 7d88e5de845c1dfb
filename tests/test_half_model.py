"""Whole-model half precision (`backends.half`, what bf16/fp16 apply on a GPU), proven on the CPU, tiny preset.

- error against fp32 within the bounds the CPU's `CastLinear` bf16 uses (tests/test_backends.py): LLM token
  agreement >= 0.90 [bf16 0.98, fp16 1.0], log-prob max abs <= 0.05 [0.016, 0.0019], mel max rel <= 5e-3
  [3.1e-3, 5.0e-4], waveform rel RMS <= 1e-3 [6.4e-5, 8.7e-6]; the token2wav engine's streaming path on the
  whole-cast estimator: max abs <= 1e-3 against fp32 as under `CastLinear`;
- no per-layer dtype conversions: a decode step of the whole-cast LLM converts no float tensor at all, and the
  estimator converts only where it is entered and left (x, mu, cond, mask and spks down; the velocity up) and
  its (B, width) time embedding; under `CastLinear` every Linear converts its input and its output;
- the LLM engine's decode step (`ModelRunner.static_decode`, what CUDA graphs capture: fused q/k/v and
  gate/up GEMMs, SDPA) compiles whole under `torch.compile(fullgraph=True, dynamic=False)` (a host sync or a
  data-dependent branch would break the graph) and equals eager: fp32 within 1e-5 of the logits' scale
  [~2e-7], the whole-cast bf16 step within 2 bf16 steps [1 step] (graph capture proven without inductor:
  aot_eager).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from token2wav_support import audio_of
from torch.utils._python_dispatch import TorchDispatchMode

from vocalis.backends.half import cast_estimator, cast_llm
from vocalis.bench.accuracy import errors, outputs
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.engine.model_runner import ModelRunner
from vocalis.engine.request import SamplingParams
from vocalis.model_dir import random_model
from vocalis.precision.layers import cast_linears
from vocalis.reference.token2wav import FlowPrompt
from vocalis.token2wav.cv2.engine import Token2WavEngine

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
FRAMES = 40


def _whole(precision: str):  # -> LoadedModel
    model = random_model("tiny")
    cast_llm(model.llm, HALF[precision])
    cast_estimator(model.flow.decoder.estimator, HALF[precision])
    return model


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return outputs(random_model("tiny"), seed=0)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_whole_cast_error_within_the_cpu_bounds(reference: dict[str, torch.Tensor], precision: str) -> None:
    model = _whole(precision)
    assert model.llm.speech_embedding.weight.dtype == HALF[precision]
    measured = errors(reference, outputs(model, seed=0))
    print(precision, "whole cast", measured)
    assert measured["llm_token_agreement"] >= 0.90 and measured["llm_logprob_max_abs"] <= 0.05
    assert measured["mel_max_rel"] <= 5e-3 and measured["wav_rel_rms"] <= 1e-3


def test_token2wav_engine_runs_the_whole_cast_estimator() -> None:
    """The engine's incremental path calls the estimator's parts on fp32 activations: it runs them as it runs
    `CastLinear` ones (its reduced compute in the estimator's dtype), close to fp32."""
    g = torch.Generator().manual_seed(0)
    prompt = FlowPrompt(torch.randint(0, 6561, (1, 30), generator=g), torch.randn(1, 60, 80, generator=g),
                        torch.randn(1, 192, generator=g))
    tokens = torch.randint(0, 6561, (60,), generator=g).tolist()
    wavs = []
    for model in (random_model("tiny"), _whole("bf16")):
        engine = Token2WavEngine(model.flow, model.hift)
        wavs.append(audio_of(engine, prompt, tokens, seed=1))
    assert engine.compute is not None and engine.compute.kind == torch.bfloat16
    assert wavs[1].shape == wavs[0].shape
    assert 0 < np.abs(wavs[1] - wavs[0]).max() <= 1e-3


class _Conversions(TorchDispatchMode):
    """Counts float -> other float dtype conversions by (from, to, shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[tuple[torch.dtype, torch.dtype, tuple[int, ...]]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if (func.overloadpacket in (torch.ops.aten.to, torch.ops.aten._to_copy) and args[0].is_floating_point()
                and out.is_floating_point() and out.dtype != args[0].dtype):
            self.seen[(args[0].dtype, out.dtype, tuple(args[0].shape))] += 1
        return out


def _decode_inputs(rows: int = 4, context: int = 64) -> tuple[torch.Tensor, ...]:
    """A padded decode step over 4 rows at positions 5, 9, 20, 33 of blocks 0..3 (block size 16): ids, positions,
    write slots (B,), gather slots and valid (B, context)."""
    positions = torch.tensor([5, 9, 20, 33])
    base = torch.arange(rows) * 16
    gather = torch.arange(context)[None].repeat(rows, 1) + base[:, None]
    valid = torch.arange(context)[None] <= positions[:, None]
    return torch.tensor([3, 17, 40, 99]), positions, base + positions, gather, valid


def _runner(model) -> ModelRunner:  # type: ignore[no-untyped-def]
    runner = LLMEngine(model.llm, EngineConfig(block_size=16, num_kv_blocks=64, fused_decode=())).runner
    assert all(pk is not None for pk in runner.packed)  # fused q/k/v and gate/up
    g = torch.Generator().manual_seed(0)
    for cache in (runner.k_cache, runner.v_cache):  # a context to attend to
        cache.copy_(torch.randn(cache.shape, generator=g).to(cache.dtype))
    return runner


def _estimator_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x, mu, cond = (torch.randn(2, 80, FRAMES, generator=g) for _ in range(3))
    return x, torch.ones(2, 1, FRAMES), mu, torch.tensor([0.3, 0.3]), torch.randn(2, 80, generator=g), cond


def _count(fn: Callable[[], object]) -> collections.Counter[tuple[torch.dtype, torch.dtype, tuple[int, ...]]]:
    with torch.inference_mode(), _Conversions() as seen:
        fn()
    return seen.seen


def test_half_forward_converts_only_at_the_boundaries() -> None:
    whole = _whole("bf16")
    runner = _runner(whole)
    assert runner.k_cache.dtype == torch.bfloat16
    step = _decode_inputs()
    assert _count(lambda: runner.static_decode(*step)) == {}  # not one float conversion in the step
    est = whole.flow.decoder.estimator
    seen = _count(lambda: est(*_estimator_inputs()))
    over_frames = sum(n for (_, _, shape), n in seen.items() if shape and shape[-1] == FRAMES)
    assert over_frames == 5  # x, mu, cond, mask down; the velocity up
    assert all(shape[-1] == FRAMES or len(shape) == 2 for (_, _, shape) in seen)  # else the (2, width) time terms
    assert sum(seen.values()) <= 12

    # the counter sees per-Linear casts where they exist: `CastLinear` converts around each of them
    cast = random_model("tiny")
    cast_linears(cast.llm, torch.bfloat16)
    cast_linears(cast.flow.decoder.estimator, torch.bfloat16)
    linears = sum(1 for m in cast.llm.qwen.layers.modules() if type(m).__name__ == "CastLinear")
    cast_runner = _runner(cast)
    assert sum(_count(lambda: cast_runner.static_decode(*step)).values()) >= linears
    est_linears = sum(1 for m in cast.flow.decoder.estimator.modules() if type(m).__name__ == "CastLinear")
    assert sum(_count(lambda: cast.flow.decoder.estimator(*_estimator_inputs())).values()) >= 2 * est_linears


@pytest.fixture(scope="module")
def runners() -> Iterator[dict[str, ModelRunner]]:
    yield {"fp32": _runner(random_model("tiny")), "bf16": _runner(_whole("bf16"))}


@pytest.mark.parametrize(("precision", "backend", "bound"), [("fp32", "inductor", 1e-5), ("bf16", "aot_eager", 2 ** -6)])
def test_decode_step_compiles_whole_and_equals_eager(runners: dict[str, ModelRunner], precision: str,
                                                     backend: str, bound: float) -> None:
    runner = runners[precision]
    step = _decode_inputs()
    with torch.inference_mode():
        eager = runner.static_decode(*step).float()
        torch._dynamo.reset()
        compiled = torch.compile(runner.static_decode, fullgraph=True, dynamic=False, backend=backend)
        got = compiled(*step).float()
    diff = ((got - eager).abs().max() / eager.abs().max()).item()
    print(precision, backend, "compiled vs eager, max rel", diff)
    assert diff <= bound


def test_tensorrt_fp16_graph_runs_close_to_fp32(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The strongly typed fp16 graph TensorRT builds from (`backends.tensorrt.half_graph_module`), run by ONNX
    Runtime on the CPU: fp32 in and out, close to the fp32 module [tiny: 1.6e-3 of its scale]."""
    pytest.importorskip("onnx")
    import onnxruntime as ort

    from vocalis.backends.onnx import export_estimator
    from vocalis.backends.tensorrt import half_graph_module

    est = random_model("tiny").flow.decoder.estimator
    path = tmp_path / "estimator_fp16.onnx"
    export_estimator(half_graph_module(est), path, streaming=False)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    args = _estimator_inputs()
    with torch.inference_mode():
        ref = est(*args).numpy()
    got = session.run(None, {k: v.numpy() for k, v in zip(("x", "mask", "mu", "t", "spks", "cond"), args)})[0]
    assert got.dtype == np.float32
    rel = float(np.abs(got - ref).max() / np.abs(ref).max())
    print("fp16 graph vs fp32 module, max rel", rel)
    assert rel <= 5e-3


@pytest.mark.parametrize(("precision", "bound"), [("bf16", 2e-2), ("fp16", 5e-3)])
def test_cosyvoice3_whole_cast(cv3_model, precision: str, bound: float) -> None:  # type: ignore[no-untyped-def]
    """CosyVoice 3 (the compat_cv3 fixture's shapes): the whole-cast DiT against fp32, one forward [bf16 7.1e-3,
    fp16 8.5e-4 of its scale], and the whole-cast LLM's decode step against fp32's [bf16 and fp16 within 5e-2]."""
    import copy

    est = cv3_model.flow.decoder.estimator
    half = copy.deepcopy(est)
    cast_estimator(half, HALF[precision])
    g = torch.Generator().manual_seed(0)
    c = est.config
    args = (torch.randn(2, c.mel_dim, FRAMES, generator=g), torch.ones(2, 1, FRAMES),
            torch.randn(2, c.mu_dim, FRAMES, generator=g), torch.tensor([0.3, 0.3]),
            torch.randn(2, c.spk_dim, generator=g), torch.randn(2, c.mel_dim, FRAMES, generator=g))
    with torch.inference_mode():
        ref, got = est(*args), half(*args)
    assert got.dtype == torch.float32
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    print(precision, "cv3 DiT whole cast, max rel", rel)
    assert rel <= bound

    llms = [copy.deepcopy(cv3_model.llm) for _ in range(2)]  # (engines pack their weights in place)
    cast_llm(llms[1], HALF[precision])
    fp32, cast = (_runner(SimpleNamespace(llm=llm)) for llm in llms)
    step = _decode_inputs()
    with torch.inference_mode():
        a, b = fp32.static_decode(*step).float(), cast.static_decode(*step).float()
    rel = ((a - b).abs().max() / a.abs().max()).item()
    print(precision, "cv3 LLM decode step, max rel", rel)
    assert rel <= 5e-2


def test_llm_engine_whole_cast_prefill_and_decode() -> None:
    """The LLM engine over the whole-cast bf16 LLM (prefill chunks of 4 positions, then decode steps): log-probs
    of its first six steps (prefill chunks, then decode steps) within the log-prob bound of fp32's [0.012]."""
    texts = [[40, 41, 42], [50, 51, 52, 53, 54, 55, 56], [60], [70, 71, 72, 73, 74], [80, 81]]

    def run(model) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
        eng = LLMEngine(model.llm, EngineConfig(block_size=16, num_kv_blocks=128, max_num_batched_tokens=4))
        for t in texts:
            eng.add_request(eng.make_request(t, params=SamplingParams(greedy=True, min_len=8, max_len=8)))
        rows = []
        while eng.scheduler.has_unfinished() and len(rows) < 6:  # prefill chunks and the first decode steps
            out = eng.scheduler.schedule()
            logp = eng.runner.execute(out.scheduled)
            rows.append(logp)
            eng.scheduler.update(out, eng.sampler(logp, out.sampled))
        return rows

    ref, got = run(random_model("tiny")), run(_whole("bf16"))
    pairs = [(a, b) for a, b in zip(ref, got) if a.numel()]
    assert pairs and all(a.shape == b.shape for a, b in pairs)
    diff = max((a - b).abs().max().item() for a, b in pairs)
    print("engine, whole-cast bf16 vs fp32: log-prob max abs", diff)
    assert diff <= 0.05
