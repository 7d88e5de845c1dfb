"""Chunk-incremental flow decoding: `CausalConditionalDecoder` on new frames only (the Euler/CFG solve over it:
`solver.solve_chunk`).

In streaming mode every estimator conv is causal and attention is block-causal (blocks of `static_chunk_size`
frames from frame 0), and the start noise is a fixed tensor indexed by absolute frame. So when a request's
frames [A, B) arrive, A on a block boundary, the trajectory of frames [0, A) at every Euler step is already
final, and the new frames need from it only, per step and guidance row:
- the keys/values of every transformer block over [0, A);
- the last `kernel - 1` input frames of every causal conv.
`EstimatorCache` (`token2wav.cv2.estimator_cache`) holds exactly that, one per Euler step, and `ChunkRun`
(`token2wav.cv2.chunk_run`) reads and extends it for each conv and attention of one call.

Batching: rows are [conditional, unconditional] of request 0, then of request 1, ... (the reference solver puts
all conditional rows first; the order of rows changes nothing in a row's arithmetic); new
frames are right-padded to the longest request (harmless: everything but attention is position-wise or causal,
and attention runs per request over its own keys). The arithmetic per op is the module's own, so results equal
the module's streaming forward on the whole prefix up to float summation order.

Legend: R requests, n new frames (padded), C channels, D transformer width, H heads, E head width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vocalis.kernels import fp32_pointwise
from vocalis.models.flow.estimator import CausalBlock1D, CausalConditionalDecoder, CausalResnetBlock1D
from vocalis.token2wav.cv2.chunk_run import ChunkRun


def _masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """x * mask; None means no row is padded (an all-ones mask: skipping it changes no value)."""
    return x if mask is None else x * mask


def _block(run: ChunkRun, block: CausalBlock1D, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    conv, _, norm, _, _ = block.block  # the last is the block's Mish
    y = run.conv(conv, _masked(x, mask))
    out = fp32_pointwise.norm_mish(y, norm) if fp32_pointwise.supports(y) else None
    if out is None:
        out = _mish(norm(y.transpose(1, 2)).transpose(1, 2))
    return _masked(out, mask)


def _mish(y: torch.Tensor) -> torch.Tensor:
    """Mish, y * tanh(softplus(y)), in one extra buffer: fewer passes over memory than torch's CPU mish kernel,
    equal to it within 1e-6."""
    out = F.softplus(y)
    return out.tanh_().mul_(y)


def _resnet(run: ChunkRun, resnet: CausalResnetBlock1D, x: torch.Tensor, mask: torch.Tensor | None,
            term: torch.Tensor) -> torch.Tensor:
    h = _block(run, resnet.block1, x, mask)
    h = h + term
    h = _block(run, resnet.block2, h, mask)
    x = _masked(x, mask)
    return h + (_res_conv(resnet.res_conv, x) if run.compute is None else run.compute.conv(resnet.res_conv, x))


def _res_conv(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A resnet's 1x1 residual conv on x (2R, C, n). Stored time-major (a transformer stack's output), as a GEMM
    over its frames, which that layout already is: oneDNN's conv reorders it first (`benchmarks/bench_pointwise.py`)."""
    if (type(conv) is nn.Conv1d and conv.kernel_size == (1,) and not x.is_contiguous()
            and x.transpose(1, 2).is_contiguous()):
        return F.linear(x.transpose(1, 2), conv.weight[:, :, 0], conv.bias).transpose(1, 2)
    return conv(x)


def _transformers(run: ChunkRun, blocks: nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
    x = h.transpose(1, 2)  # (2R, n, D), the residual stream
    if run.compute is not None:  # which may be added into in place: a copy of its own (h stays as it is)
        x = x.clone(memory_format=torch.contiguous_format)
        weights = [run.compute.block_weights(block) for block in blocks]
        if run.one_layout(x.shape[1]) and all(w is not None for w in weights):
            for w in weights:
                run.block(w, x)
            return x.transpose(1, 2)
    for block in blocks:
        x = run.attention(block.attn1, block.norm1(x), x)
        if run.compute is None:  # ff.net = [GELU projection, dropout (identity in eval), Linear]
            # GELU in place on the projection's fresh output: the same values, no second 4D-wide buffer to write
            hidden = torch.ops.aten.gelu_(block.ff.net[0].proj(block.norm3(x)))
            x = x + block.ff.net[2](hidden)
        else:  # the 4D-wide hidden stays in the compute dtype
            hidden = run.compute.linear(block.ff.net[0].proj, block.norm3(x), gelu=True)
            x = run.compute.linear_add_(x, block.ff.net[2], hidden)
    return x.transpose(1, 2)


def estimator_chunk(
    est: CausalConditionalDecoder,
    x: torch.Tensor,
    mask: torch.Tensor | None,
    mu: torch.Tensor,
    terms: list[torch.Tensor],
    spks: torch.Tensor,
    cond: torch.Tensor,
    run: ChunkRun,
) -> torch.Tensor:
    """The estimator's streaming forward on new frames: x, mu, cond (2R, 80, n), mask (2R, 1, n), the time
    step's `time_terms`, spks (2R, 80) -> velocity (2R, 80, n). mask None: no row is padded."""
    terms = iter(terms)
    spk_map = spks.unsqueeze(-1).expand(-1, -1, x.shape[-1])
    h = torch.cat([x, mu, spk_map, cond], dim=1)  # (2R, 320, n)
    skips = []
    for resnet, blocks, downsample in est.down_blocks:
        h = _transformers(run, blocks, _resnet(run, resnet, h, mask, next(terms)))
        skips.append(h)
        h = run.conv(downsample, _masked(h, mask))
    for resnet, blocks in est.mid_blocks:
        h = _transformers(run, blocks, _resnet(run, resnet, h, mask, next(terms)))
    for resnet, blocks, upsample in est.up_blocks:
        skip = skips.pop()
        h = torch.cat([h[:, :, : skip.shape[-1]], skip], dim=1)  # (2R, 2D, n)
        h = _transformers(run, blocks, _resnet(run, resnet, h, mask, next(terms)))
        h = run.conv(upsample, _masked(h, mask))
    h = _block(run, est.final_block, h, mask)
    return _masked(est.final_proj(_masked(h, mask)), mask)
