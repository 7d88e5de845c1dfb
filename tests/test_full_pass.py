"""The full-attention pass (the reference's final and offline flow call) on the incremental estimator: equal to
the module's non-streaming pass in fp32, within bf16's error on the reduced compute, for a padded batch; the
token2wav engine's reduced-compute final chunk against its module path (tiny preset, random weights)."""

from __future__ import annotations

import numpy as np
import torch

from vocalis.config import PRESETS
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.token2wav.cv2.compute import ComputeWeights
from vocalis.token2wav.cv2.solver import solve_chunk

STEPS = 4


def _flow() -> CausalMaskedDiffWithXvec:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return CausalMaskedDiffWithXvec(PRESETS["tiny"].flow).eval()


def _inputs(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = max(lens)
    mask = torch.zeros(len(lens), 1, n)
    for r, m in enumerate(lens):
        mask[r, :, :m] = 1
    mu = torch.randn(len(lens), 80, n, generator=g) * mask
    cond = torch.randn(len(lens), 80, n, generator=g) * mask
    return mu, torch.randn(len(lens), 80, generator=g), cond, mask


def _both(compute: ComputeWeights | None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    flow = _flow()
    lens = [130, 52, 20]  # several 50-frame blocks, padded rows
    mu, spks, cond, mask = _inputs(lens)
    est = flow.decoder.estimator
    with torch.inference_mode():
        want = flow.decoder(mu, mask, spks, cond, n_timesteps=STEPS, streaming=False)
        got = solve_chunk(flow.decoder, est, mu, spks, cond, [0] * 3, lens, [[], [], []], [False] * 3, STEPS,
                          compute=compute, full_attention=True)
    return got, want, lens


def test_full_attention_chunk_pass_equals_the_modules_pass() -> None:
    got, want, lens = _both(None)
    for r, m in enumerate(lens):
        torch.testing.assert_close(got[r, :, :m], want[r, :, :m], atol=1e-5, rtol=0)
        assert not got[r, :, m:].any()
    # the block-causal pass over the same frames is another function: the full mask is what is run
    flow = _flow()
    mu, spks, cond, mask = _inputs(lens)
    with torch.inference_mode():
        causal = flow.decoder(mu, mask, spks, cond, n_timesteps=STEPS, streaming=True)
    assert (causal[0, :, : lens[0]] - want[0, :, : lens[0]]).abs().max() > 1e-3


def test_full_attention_pass_in_bf16_stays_within_bf16_error() -> None:
    got, want, lens = _both(ComputeWeights(torch.bfloat16, packed=False))
    for r, m in enumerate(lens):
        err = float((got[r, :, :m] - want[r, :, :m]).abs().max() / want[r, :, :m].abs().max())
        assert err < 2e-2, err  # bf16 GEMMs and convs (attention too on AMX / AVX512-BF16 CPUs), fp32 Euler state


def test_engine_full_pass_on_reduced_compute_matches_its_module_path() -> None:
    """An engine whose estimator Linears are bf16 runs its full-attention passes (a non-streaming request here: one
    pass, as a streaming request's final chunk) on the reduced compute; the audio stays within bf16's error of the
    same engine on the modules (`compute="modules"`)."""
    from vocalis.models.hift.generator import HiFTGenerator
    from vocalis.precision.layers import cast_linears
    from vocalis.reference.token2wav import FlowPrompt
    from vocalis.token2wav.config import Token2WavConfig
    from vocalis.token2wav.cv2.engine import Token2WavEngine

    g = torch.Generator().manual_seed(3)
    prompt = FlowPrompt(torch.randint(0, 6561, (1, 30), generator=g, dtype=torch.int32),
                        torch.randn(1, 60, 80, generator=g), torch.randn(1, 192, generator=g))
    tokens = torch.randint(0, 6561, (70,), generator=g).tolist()
    out = {}
    for compute in ("auto", "modules"):
        flow = _flow()
        cast_linears(flow.decoder.estimator, torch.bfloat16)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            hift = HiFTGenerator(PRESETS["tiny"].hift).eval()
        engine = Token2WavEngine(flow, hift, Token2WavConfig(final_attention="full", compute=compute))
        assert (engine.compute is not None) == (compute == "auto")
        state = engine.new_stream("r", prompt, streaming=False, generator=torch.Generator().manual_seed(0))
        state.add_tokens(tokens)
        state.end_input()
        (chunk,) = engine.step([state])
        out[compute] = chunk.samples
    got, want = out["auto"], out["modules"]
    assert got.shape == want.shape and want.size == 70 * 2 * 480
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()


def test_engine_fp32_full_pass_runs_the_incremental_estimator_and_equals_the_modules() -> None:
    """At fp32 (no reduced compute) a non-streaming request's full-attention pass also runs on the incremental
    estimator; its audio equals the same engine on the modules' own forward (`compute="modules"`) to float
    rounding."""
    from vocalis.models.hift.generator import HiFTGenerator
    from vocalis.reference.token2wav import FlowPrompt
    from vocalis.token2wav.config import Token2WavConfig
    from vocalis.token2wav.cv2 import engine as engine_mod

    g = torch.Generator().manual_seed(4)
    prompt = FlowPrompt(torch.randint(0, 6561, (1, 30), generator=g, dtype=torch.int32),
                        torch.randn(1, 60, 80, generator=g), torch.randn(1, 192, generator=g))
    tokens = torch.randint(0, 6561, (70,), generator=g).tolist()
    out, calls = {}, []
    solve = engine_mod.solve_chunk

    def counted(*args, **kwargs):
        calls.append(kwargs.get("full_attention", False))
        return solve(*args, **kwargs)

    for compute in ("auto", "modules"):
        flow = _flow()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            hift = HiFTGenerator(PRESETS["tiny"].hift).eval()
        engine = engine_mod.Token2WavEngine(flow, hift, Token2WavConfig(final_attention="full", compute=compute))
        assert engine.compute is None  # fp32 weights: no reduced compute either way
        state = engine.new_stream("r", prompt, streaming=False, generator=torch.Generator().manual_seed(0))
        state.add_tokens(tokens)
        state.end_input()
        calls.clear()
        engine_mod.solve_chunk = counted
        try:
            (chunk,) = engine.step([state])
        finally:
            engine_mod.solve_chunk = solve
        assert calls == ([True] if compute == "auto" else [])  # which path ran the pass
        out[compute] = chunk.samples
    got, want = out["auto"], out["modules"]
    assert got.shape == want.shape and want.size == 70 * 2 * 480
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
