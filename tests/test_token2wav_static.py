"""token2wav on static shapes (`token2wav.static_flow`, `token2wav.graphs`; tiny preset, random weights, and the
CosyVoice 3 fixture): padded buckets equal the module on each row alone, the engine's static path equals its
incremental one, each hot function traces as one graph (`torch.compile(fullgraph=True, dynamic=False)`: a host
sync or a data-dependent branch would break it) and its compiled form equals eager, and half-precision compute
(fp32 Euler state) stays within the bf16 error bound the full-pass tests use.

The compile tests use the `aot_eager` backend (dynamo's whole-graph capture and AOT's functionalised aten graph,
run without codegen): inductor's C++ codegen takes minutes per bucket on a 2-core CPU, too long for the suite; the
graph is the same one inductor and CUDA graphs take. They solve 2 Euler steps (the loop is unrolled: more steps
are more of the same)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from vocalis.config import PRESETS
from vocalis.frontend.prompt import FlowPrompt
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.token2wav.config import Token2WavConfig
from vocalis.token2wav.cv2.engine import Token2WavEngine
from vocalis.token2wav.cv2.hift import BucketedBody, vocode_batch
from vocalis.token2wav.cv2.static_flow import Cv2StaticFlow
from vocalis.token2wav.cv3.static_flow import Cv3StaticFlow
from vocalis.token2wav.graphs import TOKEN_BUCKETS, BucketGraphs
from vocalis.token2wav.static_flow import FlowRow, StaticFlow

STEPS = 2
ATOL = 1e-5  # fp32 mel and audio: float summation order only [measured ~1e-6 mel, ~4e-8 audio]
HALF_REL = 2e-2  # mel max abs error / max abs, as the bf16 full-pass test [measured below, printed]
# (prompt tokens, generated tokens, look-ahead, streaming): a non-final call whose length is a bucket exactly
# (35 -> 75 + 3 = 78 tokens), a causal final call, a full-attention final call, a call with no prompt
ROWS = [(35, 43, 3, True), (12, 30, 0, True), (10, 30, 0, False), (0, 28, 3, True)]


def _prompt(n: int, seed: int, vocab: int, spk: int) -> FlowPrompt:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, n), generator=g, dtype=torch.int32)
    return FlowPrompt(ids, torch.randn(1, 2 * n, 80, generator=g), torch.randn(1, spk, generator=g))


def _rows(vocab: int, spk: int) -> list[tuple[FlowRow, torch.Tensor]]:
    out = []
    for i, (p, n, look, streaming) in enumerate(ROWS):
        prompt = _prompt(p, i, vocab, spk)
        tokens = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(10 + i), dtype=torch.int32)
        out.append((FlowRow(torch.cat([prompt.speech_ids, tokens], 1)[0].long(), look, prompt, streaming), tokens))
    return out


def _module_mels(flow: torch.nn.Module, rows: list[tuple[FlowRow, torch.Tensor]]) -> list[torch.Tensor]:
    """Each row alone through the flow module's own `inference` (STEPS Euler steps) -> mel (80, new frames)."""
    config = flow.config
    flow.config = dataclasses.replace(config, cfm=dataclasses.replace(config.cfm, n_timesteps=STEPS))
    try:
        out = []
        for row, tokens in rows:
            p = row.prompt.speech_ids
            out.append(flow.inference(tokens, torch.tensor([tokens.shape[1]]), p, torch.tensor([p.shape[1]]),
                                      row.prompt.mel, torch.tensor([row.prompt.mel.shape[1]]), row.prompt.embedding,
                                      row.streaming, row.look == 0)[0])
        return out
    finally:
        flow.config = config


def _check_rows(static: StaticFlow, rows: list[tuple[FlowRow, torch.Tensor]], want: list[torch.Tensor],
                bound: float | None = None) -> float:
    with torch.inference_mode():
        got = static([row for row, _ in rows])
    worst = 0.0
    for (row, _), g, w in zip(rows, got, want):
        g = g[:, 2 * row.prompt.speech_ids.shape[1] :]
        assert g.shape == w.shape and g.dtype == torch.float32
        if bound is None:
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
        else:
            worst = max(worst, float((g - w).abs().max() / w.abs().max()))
    assert worst <= (bound or 0.0), worst
    return worst


@pytest.fixture(scope="module")
def flow() -> CausalMaskedDiffWithXvec:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return CausalMaskedDiffWithXvec(PRESETS["tiny"].flow).eval()


@pytest.fixture(scope="module")
def hift() -> HiFTGenerator:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return HiFTGenerator(PRESETS["tiny"].hift).eval()


@pytest.fixture(scope="module")
def cv2_case(flow) -> tuple[list[tuple[FlowRow, torch.Tensor]], list[torch.Tensor]]:
    rows = _rows(6561, 192)
    with torch.inference_mode():
        return rows, _module_mels(flow, rows)


def test_buckets_hold_the_streaming_schedule_unpadded() -> None:
    """Every non-final call of the first 8 hops' sizes (prompt rounded up to 25 tokens, hops of 25, then 50 and
    100, 3 look-ahead tokens) is a bucket size: the prompt prefix and the early chunks pad nothing."""
    for prompt in range(150):
        end = -(-prompt // 25) * 25 + 25
        for hop in (0, 50, 100):
            end += hop
            if end + 3 <= 203:
                assert end + 3 in TOKEN_BUCKETS, (prompt, end)


def test_cv2_padded_buckets_equal_the_module_on_each_row_alone(flow, cv2_case) -> None:
    """Four different calls in one padded (4 rows, 78 tokens) bucket: each row's mel equals the flow module's
    `inference` on that row alone (look-ahead context, causal and full-attention final calls, no prompt)."""
    _check_rows(Cv2StaticFlow(flow, STEPS), *cv2_case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cv2_half_precision_stays_within_the_bf16_bound(flow, cv2_case, dtype: torch.dtype) -> None:
    """Encoder and estimator weights cast once to bf16 / fp16, Euler state and time MLP fp32."""
    err = _check_rows(Cv2StaticFlow(flow, STEPS, dtype=dtype), *cv2_case, bound=HALF_REL)
    print(dtype, "mel max rel", err)


def test_cv3_padded_buckets_and_bf16(cv3_model) -> None:
    """CosyVoice 3's DiT flow on the fixture: padded buckets equal the module per row; bf16 within the bound."""
    flow = cv3_model.flow
    rows = _rows(100, flow.spk_embed_affine_layer.in_features)
    with torch.inference_mode():
        want = _module_mels(flow, rows)
    _check_rows(Cv3StaticFlow(flow, STEPS), rows, want)
    print("cv3 bf16 mel max rel", _check_rows(Cv3StaticFlow(flow, STEPS, dtype=torch.bfloat16), rows, want,
                                              bound=HALF_REL))


def _compiled_equals_eager(fn, inputs: tuple[torch.Tensor, ...], atol: float) -> None:
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.inference_mode():
        torch.testing.assert_close(compiled(*inputs), fn(*inputs), atol=atol, rtol=0)


def test_cv2_flow_call_compiles_as_one_graph(flow, cv2_case) -> None:
    """Encoder + both guidance rows of every Euler step, one bucket: no graph break, equal to eager."""
    static = Cv2StaticFlow(flow, STEPS)
    key, inputs = static.inputs([row for row, _ in cv2_case[0][:2]])
    _compiled_equals_eager(static._make(key), inputs, ATOL)


def test_cv3_flow_call_compiles_as_one_graph(cv3_model) -> None:
    static = Cv3StaticFlow(cv3_model.flow, STEPS)
    key, inputs = static.inputs([row for row, _ in _rows(100, cv3_model.flow.spk_embed_affine_layer.in_features)[:1]])
    _compiled_equals_eager(static._make(key), inputs, ATOL)


def test_hift_body_in_buckets_equals_unpadded_and_compiles(hift) -> None:
    """HiFT's body on (rows, frames) buckets: each row's audio equals the plain batched vocoder's (itself equal to
    one row at a time), in bf16 / fp16 within the bf16 HiFT bound; the bucket's function traces as one graph and
    equals eager."""
    mels = [torch.randn(80, n, generator=torch.Generator().manual_seed(n)) for n in (40, 21, 60)]
    with torch.inference_mode():
        want = vocode_batch(hift, mels, [None] * 3, [torch.Generator().manual_seed(i) for i in range(3)])
        body = BucketedBody(hift)
        got = vocode_batch(hift, mels, [None] * 3, [torch.Generator().manual_seed(i) for i in range(3)], body=body)
    for (g, _), (w, _) in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    assert len(body.graphs) == 1  # one (4 rows, 64 frames) bucket
    for dtype in (torch.bfloat16, torch.float16):  # the body's convs cast once: within the bf16 HiFT bound
        with torch.inference_mode():
            half = vocode_batch(hift, mels, [None] * 3, [torch.Generator().manual_seed(i) for i in range(3)],
                                body=BucketedBody(hift, dtype=dtype))
        for (h, _), (w, _) in zip(half, want):
            rel = float((h - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt())
            assert rel <= 2e-2, (dtype, rel)  # test_backends' _HIFT_BF16_WAV [measured bf16 1.2e-2, fp16 1.7e-3]
    mel = torch.randn(2, 80, 32, generator=torch.Generator().manual_seed(1))
    s_stft = torch.randn(2, 18, 32 * body.frame_rate + 1, generator=torch.Generator().manual_seed(2))
    _compiled_equals_eager(body._call, (mel, s_stft, torch.tensor([32, 20])), 1e-5)


def _run(engine, states, specs) -> dict[str, list[np.ndarray]]:
    """End the states' input, step them together to the end -> each request's chunks (samples), in `specs` order."""
    for s in states:
        s.end_input()
    chunks: dict[str, list[np.ndarray]] = {name: [] for name, *_ in specs}
    while not all(s.finished for s in states):
        for chunk in engine.step(states):
            chunks[chunk.request_id].append(chunk.samples)
    return chunks


def _assert_same_chunks(got: dict[str, list[np.ndarray]], want: dict[str, list[np.ndarray]], atol: float) -> None:
    assert [len(c) for c in got.values()] == [len(c) for c in want.values()] == [2, 1]
    for name, chunks in want.items():
        for g, w in zip(got[name], chunks):
            assert g.shape == w.shape and float(np.abs(g - w).max()) <= atol


def test_engine_static_path_equals_the_incremental_engine(flow, hift) -> None:
    """`Token2WavConfig(graphs="eager")`: whole-prefix calls in buckets, same chunks as the cached engine (itself
    equal to the reference, tests/test_engine_token2wav.py), for a streaming and an offline request in one step."""
    specs = [("zero-shot", _prompt(35, 1, 6561, 192), 60, True), ("offline", _prompt(10, 2, 6561, 192), 20, False)]
    out = []
    for config in (Token2WavConfig(cache_dtype=None, flow_steps=STEPS),
                   Token2WavConfig(graphs="eager", flow_steps=STEPS)):
        engine = Token2WavEngine(flow, hift, config)
        states = [engine.new_stream(name, prompt, streaming=streaming, generator=torch.Generator().manual_seed(i))
                  for i, (name, prompt, _, streaming) in enumerate(specs)]
        for s, (_, _, n, _) in zip(states, specs):
            s.add_tokens(torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(n)).tolist())
        out.append(_run(engine, states, specs))
    _assert_same_chunks(out[1], out[0], ATOL)


def test_cuda_graph_modes_refuse_cpu_tensors() -> None:
    graphs = BucketGraphs(lambda key: lambda x: x * 2, "cuda-graphs")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        graphs(1, torch.ones(2))
    with pytest.raises(ValueError, match="graph mode"):
        BucketGraphs(lambda key: lambda x: x, "off")
    assert BucketGraphs(lambda key: lambda x: x * 2, "eager")(1, torch.ones(2)).tolist() == [2.0, 2.0]


def test_cv3_engine_static_path_equals_the_cached_engine(cv3_model) -> None:
    """CosyVoice 3's engine with `graphs="eager"`: the same chunks as its cached engine (streaming, causal final)
    and its full-attention final call, for a streaming and an offline request in one step."""
    from vocalis.token2wav.cv3 import CV3Token2WavEngine

    flow, spk = cv3_model.flow, cv3_model.flow.spk_embed_affine_layer.in_features
    specs = [("stream", _prompt(20, 1, 100, spk), 70, True), ("offline", _prompt(10, 2, 100, spk), 20, False)]
    for final in ("causal", "full"):
        out = []
        for graphs in ("off", "eager"):
            engine = CV3Token2WavEngine(flow, cv3_model.hift, Token2WavConfig(final_attention=final, graphs=graphs,
                                                                              flow_steps=STEPS))
            states = [engine.new_stream(name, prompt, streaming=streaming) for name, prompt, _, streaming in specs]
            for s, (_, _, n, _) in zip(states, specs):
                s.add_source_tokens(torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n)).tolist())
            out.append(_run(engine, states, specs))
        _assert_same_chunks(out[1], out[0], 1e-4)  # cv3_support.ATOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_replay_equals_eager_on_cuda(flow, hift, cv2_case) -> None:
    """On a GPU: the flow calls captured as CUDA graphs per bucket (and replayed on new inputs) equal the eager
    calls; fp16 graphs stay within the half bound; HiFT's body graphs equal its eager body."""
    import copy

    flow_cuda, hift_cuda = copy.deepcopy(flow).cuda(), copy.deepcopy(hift).cuda()
    rows = [row for row, _ in cv2_case[0]]
    with torch.inference_mode():
        want = Cv2StaticFlow(flow_cuda, STEPS, "eager")(rows)
        graphed = Cv2StaticFlow(flow_cuda, STEPS, "cuda-graphs")
        first = graphed(rows)
        again = graphed(rows[::-1])[::-1]  # the same buckets replayed on other inputs
        half = Cv2StaticFlow(flow_cuda, STEPS, "cuda-graphs", torch.float16)(rows)
    assert len(graphed.graphs) == 2  # (4 rows, 78 tokens) streaming and (1 row, 53 tokens) full attention
    for w, a, b, h in zip(want, first, again, half):
        torch.testing.assert_close(a, w, atol=ATOL, rtol=0)
        torch.testing.assert_close(b, w, atol=ATOL, rtol=0)
        assert float((h - w).abs().max() / w.abs().max()) <= HALF_REL
    mels = [torch.randn(80, n, generator=torch.Generator().manual_seed(n)).cuda() for n in (40, 21, 60)]
    with torch.inference_mode():
        outs = [vocode_batch(hift_cuda, mels, [None] * 3, [torch.Generator("cuda").manual_seed(i) for i in range(3)],
                             body=body) for body in (None, BucketedBody(hift_cuda, "cuda-graphs"))]
    for (g, _), (w, _) in zip(outs[1], outs[0]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
