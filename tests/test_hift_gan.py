"""HiFT GAN objective: discriminator shapes, loss terms, the training forward, and a few real G+D steps."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vocalis.config import HiFTConfig
from vocalis.errors import InputError
from vocalis.frontend.audio import mel_spectrogram
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.train.discriminators import DiscriminatorConfig, HiFTDiscriminator
from vocalis.train.hift_gan import (
    GeneratorOutput,
    HiFTLossConfig,
    adversarial_discriminator_loss,
    adversarial_generator_loss,
    discriminator_loss,
    feature_matching_loss,
    gan_mel,
    generator_forward,
    generator_losses,
    generator_step_losses,
    reconstruction_losses,
    tpr_loss,
)

TINY_HIFT = HiFTConfig(base_channels=16, f0_cond_channels=16)
TINY_DISC = DiscriminatorConfig(period_channels=(8, 16, 32, 32, 32), spec_channels=8)
HOP = 480


@pytest.fixture(autouse=True)
def _one_thread():
    """Small convolutions: a second intra-op thread mostly adds synchronisation on the shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _clip(frames: int = 25) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A voiced clip with a gliding pitch: (wav (1, 480 T), flow mel (1, 80, T), F0 (1, T))."""
    n = HOP * frames
    t = torch.arange(n) / 24000
    f0 = 180 + 40 * torch.sin(2 * torch.pi * 1.5 * t)
    phase = torch.cumsum(2 * torch.pi * f0 / 24000, 0)
    wav = (0.3 * sum(torch.sin(k * phase) / k for k in range(1, 6)))[None]
    return wav, mel_spectrogram(wav), f0[::HOP][None]


def test_discriminator_shapes() -> None:
    torch.manual_seed(0)
    disc = HiFTDiscriminator(TINY_DISC)
    wav = torch.randn(2, 4801) * 0.1  # not a multiple of any period: reflect-padded
    logits, fmaps = disc(wav)
    assert len(logits) == len(fmaps) == 5 + 3
    for i, (out, maps) in enumerate(zip(logits, fmaps)):
        assert out.dim() == 2 and out.shape[0] == 2 and torch.isfinite(out).all()
        assert len(maps) == 6 and all(m.shape[0] == 2 for m in maps)
        if i < 5:  # period discriminators keep the period as the last axis
            assert maps[0].shape[-1] == TINY_DISC.periods[i]
    # the official sizes (default config): MPD channels up to 1024, three STFT resolutions
    full = HiFTDiscriminator()
    assert sum(p.numel() for p in full.parameters()) > 40_000_000
    with torch.no_grad():
        full_logits, full_maps = full(torch.randn(1, 1, 2400) * 0.1)
    assert len(full_logits) == 8 and full_maps[0][3].shape[1] == 1024
    # one batch of [real; fake] gives the same logits as two calls (what discriminator_loss relies on)
    a, b = torch.randn(1, 4800) * 0.1, torch.randn(1, 4800) * 0.1
    with torch.no_grad():
        joint, _ = disc(torch.cat([a, b]))
        sep_a, _ = disc(a)
        sep_b, _ = disc(b)
    for j, x, y in zip(joint, sep_a, sep_b):
        torch.testing.assert_close(j, torch.cat([x, y]), atol=1e-5, rtol=1e-5)


def test_loss_terms() -> None:
    ones, zeros = [torch.ones(2, 7)], [torch.zeros(2, 7)]
    assert float(adversarial_generator_loss(ones)) == 0.0
    assert float(adversarial_generator_loss(zeros)) == 1.0
    assert float(adversarial_discriminator_loss(ones, zeros)) == 0.0
    assert float(adversarial_discriminator_loss(zeros, ones)) == 2.0
    assert float(adversarial_discriminator_loss(ones, [-torch.ones(2, 7)], "hinge")) == 0.0
    assert float(adversarial_generator_loss([torch.full((2, 7), 0.5)], "hinge")) == -0.5
    # feature matching: 2 x mean |r - g|, no gradient into the real maps
    real = [[torch.zeros(2, 3, requires_grad=True)]]
    fake = [[torch.ones(2, 3, requires_grad=True)]]
    fm = feature_matching_loss(real, fake)
    fm.backward()
    assert float(fm.detach()) == 2.0 and real[0][0].grad is None and fake[0][0].grad is not None
    # TPR: 0 for a constant gap, bounded by tau, finite when every point is equal
    assert float(tpr_loss([torch.ones(4, 5)], [torch.zeros(4, 5)], 0.04)) == 0.0
    spread = tpr_loss([torch.randn(4, 50) * 10], [torch.zeros(4, 50)], 0.04)
    assert 0.0 < float(spread) <= 0.04
    with pytest.raises(ValueError, match="adversarial"):
        HiFTLossConfig(adversarial="wgan")  # type: ignore[arg-type]


def test_gan_mel_is_full_band() -> None:
    wav, _, _ = _clip(10)
    assert gan_mel(wav).shape == (1, 80, 10)
    # a 10 kHz tone: above the flow mel's 8 kHz band, inside the GAN mel's (up to Nyquist, 12 kHz)
    tone = torch.sin(2 * torch.pi * 10_000 * torch.arange(4800) / 24000)[None] * 0.3
    full, flow = gan_mel(tone), mel_spectrogram(tone)
    assert int(full.mean(-1).argmax()) > 70 and float(full.max()) > 0.0
    assert float(flow.max()) < -3.0  # only window leakage reaches the flow mel


def test_training_forward_equals_inference() -> None:
    torch.manual_seed(0)
    gen = HiFTGenerator(TINY_HIFT)
    _, mel, _ = _clip(12)
    out = generator_forward(gen, mel, torch.Generator().manual_seed(3))
    ref, _ = gen.inference(mel, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(out.wav, ref, atol=0, rtol=0)
    assert out.f0.shape == (1, 12) and out.wav.requires_grad and out.f0.requires_grad


def test_step_losses_finite_and_shape_errors() -> None:
    torch.manual_seed(0)
    gen, disc = HiFTGenerator(TINY_HIFT), HiFTDiscriminator(TINY_DISC)
    wav, mel, f0 = _clip(20)
    longer = torch.cat([wav, torch.zeros(1, 100)], 1)  # up to one frame of extra target audio is cut off
    total, logs = generator_step_losses(gen, disc, mel, longer, f0)
    assert torch.isfinite(total) and set(logs) == {"loss_gen", "loss_fm", "loss_mel", "loss_tpr", "loss_f0", "loss_g"}
    assert all(math.isfinite(v) for v in logs.values())
    total.backward()
    assert all(p.grad is not None for p in gen.conv_pre.parameters())
    assert all(p.grad is not None for p in gen.f0_predictor.classifier.parameters())
    d_total, d_logs = discriminator_loss(disc, wav, torch.zeros_like(wav))
    assert torch.isfinite(d_total) and {"loss_disc", "loss_tpr", "d_real", "d_fake"} <= set(d_logs)
    fake = GeneratorOutput(torch.zeros_like(wav), f0.clone())
    with pytest.raises(InputError, match="samples"):
        generator_losses(disc, fake, wav[:, :-10], f0)
    with pytest.raises(InputError, match="F0"):
        generator_losses(disc, fake, wav, f0[:, :-1])
    with pytest.raises(InputError, match="real"):
        discriminator_loss(disc, wav[:, :-10], wav)


def test_gan_steps_reduce_mel_l1() -> None:
    torch.manual_seed(0)
    gen, disc = HiFTGenerator(TINY_HIFT), HiFTDiscriminator(TINY_DISC)
    wav, mel, f0 = _clip(25)
    opt_g = torch.optim.AdamW(gen.parameters(), 2e-3, betas=(0.8, 0.99))
    opt_d = torch.optim.AdamW(disc.parameters(), 2e-3, betas=(0.8, 0.99))

    def mel_l1() -> tuple[float, float]:  # same sine-source draw each time
        with torch.no_grad():
            out = generator_forward(gen, mel, torch.Generator().manual_seed(0))
        return float(F.l1_loss(gan_mel(out.wav), gan_mel(wav))), float(F.l1_loss(out.f0, f0))

    mel_before, f0_before = mel_l1()
    for _ in range(15):
        fake = generator_forward(gen, mel)
        d_loss, _ = discriminator_loss(disc, wav, fake.wav)
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss, _ = generator_losses(disc, fake, wav, f0)
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
    mel_after, f0_after = mel_l1()
    print(f"[hift gan] mel L1 {mel_before:.3f} -> {mel_after:.3f}, F0 L1 {f0_before:.1f} -> {f0_after:.1f} Hz")
    assert mel_after < 0.8 * mel_before
    assert f0_after < 0.9 * f0_before


def test_reconstruction_warmup_reduces_mel_l1() -> None:
    """`adversarial="none"`: mel + F0 losses only (no critic); they fall and equal their terms."""
    torch.manual_seed(0)
    gen = HiFTGenerator(TINY_HIFT)
    wav, mel, f0 = _clip(25)
    config = HiFTLossConfig(adversarial="none")
    opt = torch.optim.AdamW(gen.parameters(), 2e-3, betas=(0.8, 0.99))
    first = None
    for _ in range(15):
        fake = generator_forward(gen, mel, torch.Generator().manual_seed(0))
        total, logs = reconstruction_losses(fake, wav, f0, config)
        assert set(logs) == {"loss_mel", "loss_f0", "loss_g"}
        assert math.isclose(logs["loss_g"], 45.0 * logs["loss_mel"] + logs["loss_f0"], rel_tol=1e-5)
        first = first or logs
        opt.zero_grad()
        total.backward()
        opt.step()
    assert logs["loss_mel"] < 0.8 * first["loss_mel"]
    with pytest.raises(ValueError, match="adversarial"):
        HiFTLossConfig(adversarial="wgan")  # type: ignore[arg-type]


def test_extra_mel_windows_add_their_l1() -> None:
    """`extra_mel_ffts`: each window's log-mel L1 (hop n_fft / 4) is added to the loss, logged apart from the official one."""
    torch.manual_seed(0)
    gen = HiFTGenerator(TINY_HIFT)
    wav, mel, f0 = _clip(25)
    fake = generator_forward(gen, mel, torch.Generator().manual_seed(0))
    base = HiFTLossConfig(adversarial="none")
    multi = HiFTLossConfig(adversarial="none", extra_mel_ffts=(512, 1024))
    _, logs0 = reconstruction_losses(fake, wav, f0, base)
    total, logs = reconstruction_losses(fake, wav, f0, multi)
    n = fake.wav.shape[-1]
    by_hand = sum(
        F.l1_loss(mel_spectrogram(fake.wav, 24000, k, k // 4, 80, 0.0, None), mel_spectrogram(wav[:, :n], 24000, k, k // 4, 80, 0.0, None))
        for k in (512, 1024)
    )
    assert logs["loss_mel"] == pytest.approx(logs0["loss_mel"], rel=1e-6)
    assert logs["loss_mel_extra"] == pytest.approx(float(by_hand), rel=1e-5)
    assert float(total) == pytest.approx(45.0 * (logs["loss_mel"] + logs["loss_mel_extra"]) + logs["loss_f0"], rel=1e-5)
    total.backward()
    assert all(p.grad is not None for p in gen.parameters() if p.requires_grad)


def test_bf16_autocast_steps() -> None:
    """Under bf16 autocast the FFTs run in fp32 (no bf16 FFT/complex): both steps run and stay finite."""
    torch.manual_seed(0)
    gen, disc = HiFTGenerator(TINY_HIFT), HiFTDiscriminator(TINY_DISC)
    wav, mel, f0 = _clip(12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fake = generator_forward(gen, mel)
        d_loss, _ = discriminator_loss(disc, wav, fake.wav)
        g_loss, _ = generator_losses(disc, fake, wav, f0)
    assert fake.wav.dtype == torch.float32 and torch.isfinite(d_loss) and torch.isfinite(g_loss)
    (d_loss + g_loss).backward()
    assert all(torch.isfinite(p.grad).all() for p in gen.parameters() if p.grad is not None)
