"""A conv block's LayerNorm + Mish on our kernel (`vocalis.kernels.fp32_pointwise`), at this CPU's own level and at
the AVX2 level (forced on CPUs with more: the other source set), against float64 math: both layouts the estimator
hands it (channel-major from torch's convs, time-major from the int8 convs), frame and channel counts off the
vector width, large and tiny values; and the token2wav engine's audio on it equal to its audio on torch's passes.

Bound: within 4e-6 of the output's largest value (fp32 sums over a frame's channels, exp to ~1e-7 relative)
[measured ~1e-6, torch's passes the same]."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from token2wav_support import audio_of
from torch import nn

from vocalis.config import PRESETS
from vocalis.kernels import fp32_pointwise
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.precision.dynamic_int8 import quantize_estimator_int8
from vocalis.reference.token2wav import FlowPrompt
from vocalis.token2wav.config import Token2WavConfig
from vocalis.token2wav.cv2.engine import Token2WavEngine

pytestmark = pytest.mark.usefixtures("native_level")


def _exact(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    z = F.layer_norm(x.double().transpose(1, 2), (x.shape[1],), norm.weight.double(), norm.bias.double(),
                     norm.eps).transpose(1, 2)
    return z * torch.tanh(F.softplus(z))


@pytest.mark.parametrize("time_major", [True, False])
@pytest.mark.parametrize(("B", "C", "T"), [(2, 256, 100), (3, 20, 13), (1, 8, 1), (2, 37, 8), (4, 64, 9)])
def test_norm_mish_against_exact(B: int, C: int, T: int, time_major: bool) -> None:
    g = torch.Generator().manual_seed(B * C + T)
    norm = nn.LayerNorm(C)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(C, generator=g) * 6 + 0.1)  # affine outputs from ~-30 to ~+30: both Mish tails
        norm.bias.copy_(torch.randn(C, generator=g) * 4)
    x = torch.randn(B, T, C, generator=g).transpose(1, 2) if time_major else torch.randn(B, C, T, generator=g)
    x = x * 5 + 2
    with torch.no_grad():
        out = fp32_pointwise.norm_mish(x, norm)
    assert out.shape == x.shape  # in the input's layout:
    assert out.is_contiguous() == x.is_contiguous()
    assert out.transpose(1, 2).is_contiguous() == x.transpose(1, 2).is_contiguous()
    exact = _exact(x, norm)
    assert (out.double() - exact).abs().max() <= 4e-6 * exact.abs().max()


def test_norm_mish_refuses_other_layouts() -> None:
    x = torch.randn(2, 16, 10, 3)[..., 0]  # neither layout
    assert fp32_pointwise.norm_mish(x, nn.LayerNorm(16)) is None


@pytest.mark.parametrize("int8", [False, True])
def test_engine_on_the_kernel_equals_torch_passes(int8: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream through the token2wav engine (tiny preset, random weights; fp32, or the int8 estimator with its
    time-major conv outputs) gives the same audio with the kernel as with torch's passes."""
    cfg = PRESETS["tiny"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        flow, hift = CausalMaskedDiffWithXvec(cfg.flow).eval(), HiFTGenerator(cfg.hift).eval()
    if int8:
        quantize_estimator_int8(flow.decoder.estimator, convs=True)
    g = torch.Generator().manual_seed(1)
    prompt = FlowPrompt(torch.randint(0, 6561, (1, 30), generator=g, dtype=torch.int32),
                        torch.randn(1, 60, 80, generator=g), torch.randn(1, 192, generator=g))
    tokens = torch.randint(0, 6561, (60,), generator=g).tolist()

    def audio() -> np.ndarray:
        return audio_of(Token2WavEngine(flow, hift, Token2WavConfig(cache_dtype=None)), prompt, tokens, seed=2)

    calls = []
    kernel = fp32_pointwise.norm_mish
    monkeypatch.setattr(fp32_pointwise, "norm_mish", lambda x, norm: calls.append(1) or kernel(x, norm))
    ours = audio()
    assert calls  # the kernel ran
    monkeypatch.setattr(fp32_pointwise, "supports", lambda x: False)
    torch_passes = audio()
    # fp32: summation order only; int8: an fp32 ulp can move an activation across an 8-bit rounding step, which
    # the dynamic GEMMs carry forward (~1e-4 of the range; the int8 estimator's own error against fp32 is ~1e-2)
    bound = 1e-3 if int8 else 1e-5
    assert np.abs(ours - torch_passes).max() <= bound * np.abs(torch_passes).max()
