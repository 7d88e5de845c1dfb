"""The multi-resolution STFT term of the HiFT objective (rung L1 of the built-in model)."""

from __future__ import annotations

import torch

from vocalis.train.config import load_config
from vocalis.train.hift_gan import GeneratorOutput, HiFTLossConfig, multi_resolution_stft_loss, reconstruction_losses

RES = ((512, 50, 240), (1024, 120, 600), (2048, 240, 1200))


def _tone(freq: float, n: int = 24000, noise: float = 0.0, seed: int = 0) -> torch.Tensor:
    t = torch.arange(n) / 24000.0
    g = torch.Generator().manual_seed(seed)
    return (0.5 * torch.sin(2 * torch.pi * freq * t) + noise * torch.randn(n, generator=g)).unsqueeze(0)


def test_zero_on_identical_audio_and_ordered_by_distance() -> None:
    real = _tone(220.0, noise=0.01)
    sc, mag = multi_resolution_stft_loss(real, real, RES)
    assert float(sc) == 0.0 and float(mag) == 0.0
    near = multi_resolution_stft_loss(_tone(225.0, noise=0.01, seed=1), real, RES)
    far = multi_resolution_stft_loss(_tone(1800.0, noise=0.01, seed=1), real, RES)
    assert 0 < float(near[0]) < float(far[0]) and 0 < float(near[1]) < float(far[1])


def test_gradient_reaches_the_waveform_and_enters_the_total() -> None:
    real = _tone(300.0, noise=0.02)
    fake = (real + 0.1 * torch.randn_like(real)).requires_grad_(True)
    f0 = torch.full((1, 50), 300.0)
    out = GeneratorOutput(fake, f0)
    off, logs_off = reconstruction_losses(out, real, f0, HiFTLossConfig(adversarial="none"))
    on, logs_on = reconstruction_losses(out, real, f0, HiFTLossConfig(adversarial="none", stft_weight=2.0))
    assert "loss_stft_sc" not in logs_off and logs_on["loss_stft_sc"] > 0 and logs_on["loss_stft_mag"] > 0
    assert abs(float((on - off).detach()) - 2.0 * (logs_on["loss_stft_sc"] + logs_on["loss_stft_mag"])) < 1e-3
    on.backward()
    assert fake.grad is not None and torch.isfinite(fake.grad).all() and float(fake.grad.abs().sum()) > 0


def test_training_config_carries_the_term() -> None:
    cfg = load_config(None, ["hift.stft_weight=15", "hift.stft_resolutions=[[256, 64, 256]]"], task="hift")
    assert cfg.hift.stft_weight == 15.0 and cfg.hift.stft_resolutions == ((256, 64, 256),)
