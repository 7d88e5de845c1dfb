"""The Euler/CFG solve of one chunk of new frames for a batch of requests, on the incremental estimator
(`estimator.estimator_chunk`), with the time terms kept per Euler step (`TimeTerms`)."""

from __future__ import annotations

import torch

from vocalis.errors import InputError
from vocalis.models.flow.cfm import CausalConditionalCFM, cosine_time_grid
from vocalis.models.flow.estimator import CausalConditionalDecoder
from vocalis.precision.dynamic_int8 import FusedQKV
from vocalis.token2wav.cache_storage import compact
from vocalis.token2wav.cv2.chunk_run import ChunkRun
from vocalis.token2wav.cv2.compute import ComputeWeights
from vocalis.token2wav.cv2.estimator import estimator_chunk
from vocalis.token2wav.cv2.estimator_cache import EstimatorCache


def time_terms(est: CausalConditionalDecoder, t: torch.Tensor) -> list[torch.Tensor]:
    """Time t (scalar) -> every resnet's projection of the time MLP's output, (1, C, 1) each, in block order
    (down, mid, up): the estimator's whole dependence on t, the same for every request and guidance row."""
    temb = est.time_mlp(est.time_embeddings(t.reshape(1)).to(t.dtype))  # (1, 4D)
    return [blocks[0].mlp(temb).unsqueeze(-1) for blocks in (*est.down_blocks, *est.mid_blocks, *est.up_blocks)]


class TimeTerms:
    """`time_terms` kept per Euler step: a solve's t values are the same every call (same grid, same
    arithmetic), so an engine computes them once instead of per step and chunk (the time MLP and 14 small
    projections per Euler step: ~3 % of a first-chunk token2wav step at the 0.5B shapes)."""

    def __init__(self, estimator: CausalConditionalDecoder) -> None:
        self.estimator = estimator
        self._terms: dict[tuple[int, int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    def get(self, n_timesteps: int, step: int, t: torch.Tensor) -> list[torch.Tensor]:
        key = (n_timesteps, step, t.dtype, t.device)
        terms = self._terms.get(key)
        if terms is None:
            terms = self._terms[key] = time_terms(self.estimator, t)
        return terms


def solve_chunk(
    cfm: CausalConditionalCFM,
    estimator: CausalConditionalDecoder,
    mu: torch.Tensor,
    spks: torch.Tensor,
    cond: torch.Tensor,
    starts: list[int],
    lens: list[int],
    caches: list[list[EstimatorCache]],
    keeps: list[bool],
    n_timesteps: int,
    cache_dtype: torch.dtype | None = None,
    compute: ComputeWeights | None = None,
    terms: TimeTerms | None = None,
    full_attention: bool = False,
    qkv: FusedQKV | None = None,
) -> torch.Tensor:
    """Euler + CFG on new frames. mu, cond (R, 80, n), spks (R, 80); row r covers absolute frames
    [starts[r], starts[r] + lens[r]); caches[r] holds one `EstimatorCache` per Euler step (created on first use)
    and is extended when keeps[r] (a cached chunk must end on a block boundary); cache_dtype stores the cached
    keys/values reduced (e.g. bf16: half the memory, upcast when read); compute runs the estimator's GEMMs, convs
    and attention in a reduced dtype (`ComputeWeights`; None: the modules as they are); terms keeps the time terms
    across calls (None: computed per step); qkv runs int8 modules' q/k/v projections as one GEMM (`FusedQKV`).
    full_attention: every frame sees every frame of its request (the estimator's non-streaming mask: the
    reference's final and offline pass), from frame 0, keeping nothing.
    Returns mel (R, 80, n) float32 (zeros on padding)."""
    num, _, n = mu.shape
    dev, dtype = mu.device, mu.dtype
    noise = cfm.rand_noise
    z = torch.zeros(num, mu.shape[1], n, dtype=dtype, device=dev)
    mask = torch.zeros(num, 1, n, dtype=dtype, device=dev)
    for r, (s, m) in enumerate(zip(starts, lens)):
        if s + m > noise.shape[-1]:
            raise InputError(
                f"{s + m} mel frames exceed the fixed flow noise ({noise.shape[-1]} frames); "
                "synthesise shorter segments"
            )
        z[r, :, :m] = noise[0, :, s : s + m].to(device=dev, dtype=dtype)
        mask[r, :, :m] = 1
    for r, per_step in enumerate(caches):
        while len(per_step) < n_timesteps:
            per_step.append(EstimatorCache())
        for c in per_step:
            if c.num_frames != starts[r]:
                raise ValueError(f"estimator cache holds {c.num_frames} frames, the chunk starts at {starts[r]}")
        if keeps[r] and (starts[r] + lens[r]) % estimator.static_chunk_size:
            raise ValueError(f"a cached chunk must end on a {estimator.static_chunk_size}-frame block boundary")
    chunk = estimator.static_chunk_size
    if full_attention:
        if any(keeps) or any(starts):
            raise ValueError("a full-attention pass starts at frame 0 and keeps nothing")
        chunk = max(lens)  # one block: nothing hidden but padding
    cfg = cfm.config.inference_cfg_rate
    # rows request-major: (conditional, unconditional) of request 0, then of request 1, ... so a request's pair
    # is a slice (a view) for the caches
    # (2R, 1, n); None when every row fills all n frames (all ones: the estimator skips multiplying by it)
    mask_in = None if all(m == n for m in lens) else mask.repeat_interleave(2, dim=0)
    mu_in = torch.stack([mu, torch.zeros_like(mu)], dim=1).flatten(0, 1)
    spks_in = torch.stack([spks, torch.zeros_like(spks)], dim=1).flatten(0, 1)
    cond_in = torch.stack([cond, torch.zeros_like(cond)], dim=1).flatten(0, 1)
    t_span = cosine_time_grid(n_timesteps, dtype, dev)
    x = z
    t = t_span[0]
    dt = t_span[1] - t_span[0]
    for step in range(1, len(t_span)):
        run = ChunkRun([per_step[step - 1] for per_step in caches], lens, keeps, chunk, cache_dtype, compute, qkv)
        step_terms = time_terms(estimator, t) if terms is None else terms.get(n_timesteps, step, t)
        v = estimator_chunk(estimator, x.repeat_interleave(2, dim=0), mask_in, mu_in, step_terms, spks_in,
                            cond_in, run).view(num, 2, *x.shape[1:])
        if dev.type == "cpu":  # this step's new caches out of malloc's arenas (`cache_storage`)
            for r, per_step in enumerate(caches):
                if keeps[r]:
                    compact(per_step[step - 1])
        x = x + dt * ((1.0 + cfg) * v[:, 0] - cfg * v[:, 1])
        t = t + dt
        if step < len(t_span) - 1:
            dt = t_span[step + 1] - t
    for r, per_step in enumerate(caches):
        if keeps[r]:
            for c in per_step:
                c.num_frames = starts[r] + lens[r]
    return (x * mask).float()
