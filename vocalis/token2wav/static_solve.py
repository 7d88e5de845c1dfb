"""The whole Euler/CFG solve of a flow call as one graph-safe function of static-shape tensors (`EulerSolve`),
for CosyVoice 2's U-Net estimator and CosyVoice 3's DiT alike (a `Velocity` each: `cv2.static_flow`,
`cv3.static_flow`).

Graph-safe: every shape is fixed by the inputs' (rows, frames) bucket, the step count is a Python constant, the
time grid's steps and each step's time terms are constants made once (`EulerSolve.__init__`), and the masks are
tensors built from the rows' valid lengths. Nothing reads a tensor on the host, nothing branches on data, so the
function traces as one graph (`torch.compile(fullgraph=True)`) and replays as one CUDA graph per bucket.

Precision: the estimator may run in a half dtype (its weights cast once, `half_copy`); the Euler state, the time
grid and the time MLP stay fp32 (the time terms are computed in fp32 and cast), and the velocity is widened to fp32
before it joins the state. Norms and softmax take half inputs and accumulate in fp32 inside their kernels.

Arithmetic: the module solver's (`CausalConditionalCFM.solve_euler`): t accumulates dt and the next dt is measured
from that t; guidance rows [0, R) conditional and [R, 2R) unconditional (mu, spks, cond zeroed).

Legend: R rows (requests, padded to a bucket), T frames (padded), C = 80 mel channels.
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch
from torch import nn

from vocalis.models.flow.cfm import cosine_time_grid


class Velocity(Protocol):
    """One family's estimator on static shapes: x, mu, cond (2R, C, T), spks (2R, C), mask (2R, 1, T), the step's
    time terms, `attn` (the call's attention mask, made once per solve by `attention`) -> v (2R, C, T)."""

    dtype: torch.dtype

    def time_terms(self, t: torch.Tensor) -> torch.Tensor: ...

    def attention(self, mask: torch.Tensor, streaming: bool) -> torch.Tensor: ...

    def __call__(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, terms: torch.Tensor,
                 spks: torch.Tensor, cond: torch.Tensor, attn: torch.Tensor) -> torch.Tensor: ...


def half_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `module` with every float parameter and buffer cast to `dtype` once (fp32: the module itself)."""
    if dtype == torch.float32:
        return module
    return copy.deepcopy(module).to(dtype)


class EulerSolve:
    """All `n_timesteps` Euler/CFG steps over both guidance rows as one function (`__call__`).

    noise: the fixed start noise (1, C, >= T) (`CausalConditionalCFM.rand_noise`), frames counted from 0."""

    def __init__(self, velocity: Velocity, noise: torch.Tensor, n_timesteps: int, cfg_rate: float) -> None:
        self.velocity = velocity
        self.noise = noise
        self.cfg = float(cfg_rate)
        t_span = cosine_time_grid(n_timesteps, torch.float32, noise.device)
        self.dts: list[float] = []
        terms = []
        t, dt = t_span[0], t_span[1] - t_span[0]
        with torch.inference_mode():
            for step in range(1, len(t_span)):
                terms.append(velocity.time_terms(t))
                self.dts.append(float(dt))  # the fp32 value exactly; the Euler update below is fp32
                t = t + dt
                if step < len(t_span) - 1:
                    dt = t_span[step + 1] - t
        self.terms = terms  # per step: constants of the graph

    def __call__(self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                 streaming: bool) -> torch.Tensor:
        """mu, cond (R, C, T), mask (R, 1, T) (1.0 on valid frames), spks (R, C), all fp32 -> mel (R, C, T) fp32,
        zero on padding. Rows are independent: a row's valid frames come out as if solved alone."""
        dtype = self.velocity.dtype
        r, c, n = mu.shape
        x = self.noise[:, :, :n].to(mu.device).expand(r, c, n) * mask  # the Euler state, fp32
        mask_in = torch.cat([mask, mask]).to(dtype)  # (2R, 1, T)
        mu_in = torch.cat([mu, torch.zeros_like(mu)]).to(dtype)
        spks_in = torch.cat([spks, torch.zeros_like(spks)]).to(dtype)
        cond_in = torch.cat([cond, torch.zeros_like(cond)]).to(dtype)
        attn = self.velocity.attention(mask_in, streaming)
        for dt, terms in zip(self.dts, self.terms):
            v = self.velocity(torch.cat([x, x]).to(dtype), mask_in, mu_in, terms.to(mu.device), spks_in, cond_in,
                              attn).float()
            x = x + dt * ((1.0 + self.cfg) * v[:r] - self.cfg * v[r:])
        return x * mask
