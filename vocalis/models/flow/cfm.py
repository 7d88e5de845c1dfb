"""Conditional flow matching `CausalConditionalCFM`: Euler solver with classifier-free guidance, training loss.

Inference integrates dx/dt = v(x, t | mu, spks, cond) from t = 0 (noise) to t = 1 (mel) on the cosine time grid
t_i = 1 - cos(pi/2 * i/n). The start point is a fixed noise tensor sliced by absolute frame index, so re-running
on a longer prefix reproduces the earlier frames (what makes chunked streaming consistent). Guidance runs the
estimator once on 2B rows: B conditional rows, then the same B rows with mu, spks and cond zeroed.

Shapes: B batch (requests), T mel frames, 80 mel bins.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vocalis.config import CFMConfig, EstimatorConfig
from vocalis.errors import InputError
from vocalis.models.flow.estimator import CausalConditionalDecoder


def fixed_noise(mel_dim: int, num_frames: int, seed: int) -> torch.Tensor:
    """The official start noise (1, mel_dim, num_frames): one CPU `randn` right after seeding with `seed`.

    Uses a private generator, so the global RNG is neither read nor reset.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn((1, mel_dim, num_frames), generator=gen, dtype=torch.float32, device="cpu")


def cosine_time_grid(
    n_timesteps: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> torch.Tensor:
    """t_i = 1 - cos(pi/2 * i/n) for i = 0..n, shape (n + 1,)."""
    t_span = torch.linspace(0, 1, n_timesteps + 1, dtype=dtype, device=device)
    return 1 - torch.cos(t_span * 0.5 * math.pi)


class CausalConditionalCFM(nn.Module):
    """Flow decoder: start noise + Euler/CFG solver around `estimator` (a `CausalConditionalDecoder`)."""

    rand_noise: torch.Tensor

    def __init__(self, cfm: CFMConfig, estimator: EstimatorConfig | nn.Module, mel_dim: int = 80) -> None:
        super().__init__()
        self.config = cfm
        self.mel_dim = mel_dim
        # a built module (CosyVoice 3's DiT) takes the U-Net's place; it has the same call signature
        self.estimator = estimator if isinstance(estimator, nn.Module) else CausalConditionalDecoder(estimator)
        # Not persistent: the official code keeps it as a plain attribute, so flow.pt has no such key. Built on
        # CPU explicitly so it stays real when the module is constructed on the meta device.
        self.register_buffer("rand_noise", fixed_noise(mel_dim, cfm.noise_frames, cfm.noise_seed), persistent=False)

    def start_noise(self, batch: int, num_frames: int, temperature: float = 1.0) -> torch.Tensor:
        """Euler start point (batch, mel_dim, num_frames): the first frames of the fixed noise, times temperature."""
        if num_frames > self.rand_noise.shape[-1]:
            raise InputError(
                f"{num_frames} mel frames exceed the fixed flow noise ({self.rand_noise.shape[-1]} frames); "
                "synthesise shorter segments"
            )
        return self.rand_noise[:, :, :num_frames].expand(batch, -1, -1) * temperature  # (B, 80, T)

    @torch.inference_mode()
    def forward(
        self,
        mu: torch.Tensor,
        mask: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        n_timesteps: int = 10,
        temperature: float = 1.0,
        streaming: bool = False,
    ) -> torch.Tensor:
        """mu (B, 80, T), mask (B, 1, T), spks (B, 80), cond (B, 80, T) -> mel (B, 80, T), float32.

        Rows are independent: a batch of requests padded to a common T (mask 0 on the padding) gives, on each
        request's valid frames, the same mel as running it alone.
        """
        z = self.start_noise(mu.shape[0], mu.shape[-1], temperature).to(device=mu.device, dtype=mu.dtype)
        t_span = cosine_time_grid(n_timesteps, mu.dtype, mu.device)
        return self.solve_euler(z, t_span, mu, mask, spks, cond, streaming)

    def solve_euler(
        self,
        x: torch.Tensor,
        t_span: torch.Tensor,
        mu: torch.Tensor,
        mask: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        streaming: bool = False,
    ) -> torch.Tensor:
        """Fixed-step Euler with classifier-free guidance from x = x(t_span[0]) (B, 80, T) -> x(t_span[-1])."""
        b = x.shape[0]
        cfg = self.config.inference_cfg_rate
        # Guidance batch: rows [0, B) conditional, rows [B, 2B) unconditional (mu, spks, cond zeroed).
        mask_in = torch.cat([mask, mask], dim=0)  # (2B, 1, T)
        mu_in = torch.cat([mu, torch.zeros_like(mu)], dim=0)  # (2B, 80, T)
        spks_in = torch.cat([spks, torch.zeros_like(spks)], dim=0)  # (2B, 80)
        cond_in = torch.cat([cond, torch.zeros_like(cond)], dim=0)  # (2B, 80, T)

        # Same arithmetic as the official loop: t accumulates dt, and the next dt is measured from that t.
        t = t_span[0]
        dt = t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            x_in = torch.cat([x, x], dim=0)  # (2B, 80, T)
            t_in = t.expand(2 * b)  # (2B,)
            v = self.estimator(x_in, mask_in, mu_in, t_in, spks_in, cond_in, streaming)  # (2B, 80, T)
            v_cond, v_uncond = v[:b], v[b:]
            x = x + dt * ((1.0 + cfg) * v_cond - cfg * v_uncond)
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return x.float()

    def compute_loss(
        self,
        x1: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        streaming: bool = False,
        generator: torch.Generator | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Conditional flow-matching loss (scalar) for target mel x1 (B, 80, T), mask (B, 1, T).

        `loss_mask` (B, 1, T) selects the frames the loss counts (default: `mask`); attention still sees every
        valid frame, so a prompt prefix can condition the model without being a target.

        Draws, in order from `generator`: t ~ U(0, 1) per sample (cosine-warped, as the released weights were
        trained), noise x0 ~ N(0, I) like x1, and the per-sample guidance dropout that zeroes mu, spks and cond
        together with probability `training_cfg_rate`. Loss = sum(((v - u) * mask)^2) / (sum(mask) * 80).
        """
        b = x1.shape[0]
        sigma = self.config.sigma_min
        t = torch.rand((b, 1, 1), generator=generator, device=x1.device, dtype=x1.dtype)
        t = 1 - torch.cos(t * 0.5 * math.pi)
        x0 = torch.randn(x1.shape, generator=generator, device=x1.device, dtype=x1.dtype)
        y = (1 - (1 - sigma) * t) * x0 + t * x1  # (B, 80, T)
        u = x1 - (1 - sigma) * x0  # (B, 80, T) target velocity
        if self.config.training_cfg_rate > 0:
            keep = torch.rand((b,), generator=generator, device=x1.device) > self.config.training_cfg_rate
            keep = keep.to(x1.dtype)
            mu = mu * keep.view(-1, 1, 1)
            spks = spks * keep.view(-1, 1)
            cond = cond * keep.view(-1, 1, 1)
        pred = self.estimator(y, mask, mu, t.view(b), spks, cond, streaming)
        counted = mask if loss_mask is None else loss_mask * mask
        return F.mse_loss(pred * counted, u * counted, reduction="sum") / (counted.sum().clamp(min=1) * u.shape[1])
