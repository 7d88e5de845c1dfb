"""A wider HiFT vocoder started from a narrower one (`vocalis.train.widen`): same audio at the start, copies that
train apart. The recipe's use of it: tests/test_builtin_gate.py."""

from __future__ import annotations

import pytest
import torch

from vocalis.config import PRESETS
from vocalis.models.hift.generator import HiFTGenerator, hift_config_for
from vocalis.train.widen import widen_hift


def _narrow() -> HiFTGenerator:
    torch.manual_seed(0)
    hift = HiFTGenerator(PRESETS["builtin"].hift)
    with torch.no_grad():  # trained-looking weights: Snake alphas and biases away from their initial values
        for name, p in hift.named_parameters():
            if name.endswith((".alpha", ".bias")):
                p.add_(0.3 * torch.randn_like(p))
    return hift.eval()


@pytest.mark.parametrize("factor", [2, 4])
def test_widened_hift_decodes_the_same_audio(factor: int) -> None:
    narrow = _narrow()
    config = narrow.config
    state, wide_config = widen_hift(narrow.state_dict(), config, config.base_channels * factor)
    wide = HiFTGenerator(wide_config).eval()
    wide.load_state_dict(state, strict=True)
    assert hift_config_for(state, config) == wide_config
    assert sum(p.numel() for p in wide.parameters()) > 2 * sum(p.numel() for p in narrow.parameters())
    mel = torch.randn(2, 80, 30)
    with torch.no_grad():
        s = narrow.source(mel, torch.Generator().manual_seed(1))  # (2, 1, N)
        a, b = narrow.decode(mel, s), wide.decode(mel, s)
    assert a.abs().max() > 0.05
    torch.testing.assert_close(b, a, atol=1e-4, rtol=0)


def test_widened_copies_get_different_gradients() -> None:
    """Copied channels whose outgoing weights were split alike would train as one forever; the random shares
    break that symmetry."""
    narrow = _narrow()
    state, wide_config = widen_hift(narrow.state_dict(), narrow.config, 128)
    wide = HiFTGenerator(wide_config)
    wide.load_state_dict(state)
    mel = torch.randn(1, 80, 20)
    s = narrow.source(mel, torch.Generator().manual_seed(2)).detach()
    wide.decode(mel, s).pow(2).mean().backward()
    grad = wide.conv_pre.parametrizations.weight.original1.grad  # (128, 80, 7): channel c and its copy c + 64
    assert not torch.allclose(grad[:64], grad[64:], atol=1e-7)


def test_widening_needs_a_whole_multiple() -> None:
    narrow = _narrow()
    with pytest.raises(ValueError, match="multiple of 64"):
        widen_hift(narrow.state_dict(), narrow.config, 96)
