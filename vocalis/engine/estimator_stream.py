"""Chunk-incremental flow decoding: the CFM Euler/CFG solver and `CausalConditionalDecoder` on new frames only.

In streaming mode every estimator conv is causal and attention is block-causal (blocks of `static_chunk_size`
frames from frame 0), and the start noise is a fixed tensor indexed by absolute frame. So when a request's
frames [A, B) arrive, A on a block boundary, the trajectory of frames [0, A) at every Euler step is already
final, and the new frames need from it only, per step and guidance row:
- the keys/values of every transformer block over [0, A);
- the last `kernel - 1` input frames of every causal conv.
`EstimatorCache` holds exactly that, one per Euler step. Memory per cached frame, at the 0.5B shapes:
56 blocks x (K + V = 2 x 512) x 2 guidance rows x 10 steps = 1.15 M values (4.6 MB in fp32); a request's
cache is dropped when it finishes, and a voice's prompt prefix is shared (`EstimatorCache.prefix`), never copied.

Batching: rows are [conditional, unconditional] of request 0, then of request 1, ... (the reference solver puts
all conditional rows first; the order of rows changes nothing in a row's arithmetic); new
frames are right-padded to the longest request (harmless: everything but attention is position-wise or causal,
and attention runs per request over its own keys). The arithmetic per op is the module's own, so results equal
the module's streaming forward on the whole prefix up to float summation order.

Legend: R requests, n new frames (padded), C channels, D transformer width, H heads, E head width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from vocalis.errors import InputError
from vocalis.models.flow.cfm import CausalConditionalCFM, cosine_time_grid
from vocalis.models.flow.estimator import CausalBlock1D, CausalConditionalDecoder, CausalResnetBlock1D
from vocalis.models.flow.transformer import SelfAttention

_MASK_BIAS = -1.0e10  # the estimator's additive mask value


@dataclass
class EstimatorCache:
    """One request at one Euler step: keys/values per transformer block and input tails per causal conv.

    Tensors are (2, ...) with the conditional row first; they are replaced, never written in place.
    A request that starts from a voice's shared prompt prefix points at it (`prefix`, read only, shared by every
    request of that voice) and holds only its own frames [prefix.num_frames, num_frames) in `keys`/`values`,
    so its memory is its own frames, not the prompt's again.
    """

    keys: list[torch.Tensor] = field(default_factory=list)  # per block (2, H, own frames, E)
    values: list[torch.Tensor] = field(default_factory=list)
    tails: list[torch.Tensor] = field(default_factory=list)  # per causal conv (2, C_in, kernel - 1)
    num_frames: int = 0  # frames covered, the prefix's included
    prefix: EstimatorCache | None = None

    @classmethod
    def on_prefix(cls, prefix: EstimatorCache) -> EstimatorCache:
        """An empty per-request cache continuing a shared prefix (which must not itself have one)."""
        if prefix.prefix is not None:
            raise ValueError("a shared prefix cache cannot itself continue a prefix")
        return cls([], [], list(prefix.tails), prefix.num_frames, prefix)

    def nbytes(self) -> int:
        """This cache's own bytes (a shared prefix is not counted)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, *self.tails))


class _ChunkRun:
    """Walks the estimator for one call, pairing each conv/attention with its slot in the per-request caches."""

    def __init__(self, caches: list[EstimatorCache], lens: list[int], keeps: list[bool], chunk: int,
                 cache_dtype: torch.dtype | None = None) -> None:
        self.caches = caches
        self.cache_dtype = cache_dtype
        self.lens = lens
        self.keeps = keeps
        self.chunk = chunk
        self.conv_index = 0
        self.block_index = 0

    def conv(self, conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
        """Causal conv x (2R, C, n) -> (2R, C_out, n), left context from the caches."""
        i = self.conv_index
        self.conv_index += 1
        ctx = conv.kernel_size[0] - 1
        if not all(len(c.tails) > i for c in self.caches):
            zero = x.new_zeros(2, x.shape[1], ctx)
            for c in self.caches:
                if len(c.tails) == i:
                    c.tails.append(zero)
        left = torch.cat([c.tails[i].to(x.dtype) for c in self.caches])  # (2R, C, ctx), request-major
        full = torch.cat([left, x], dim=2)  # (2R, C, ctx + n)
        for r, c in enumerate(self.caches):
            if self.keeps[r]:
                m = self.lens[r]
                c.tails[i] = full[2 * r : 2 * r + 2, :, m : m + ctx].clone()
        return F.conv1d(full, conv.weight, conv.bias)

    def attention(self, attn: SelfAttention, x: torch.Tensor) -> torch.Tensor:
        """Self-attention of new frames x (2R, n, D) over cached + new keys -> (2R, n, D).

        One attention call for the whole batch: each request's keys (shared prefix, own cached frames, new
        frames) are laid out from position 0 in a (2R, H, K, E) tensor, K the longest, and a per-row additive
        mask hides what the block-causal mask hides plus the padding (weight exactly 0, as exp(-1e10) is).
        A voice prefix shared by several requests is upcast once per call, not once per request."""
        i = self.block_index
        self.block_index += 1
        rows, n, _ = x.shape
        h, e = attn.num_heads, attn.head_dim
        q = attn.to_q(x).view(rows, n, h, e).transpose(1, 2)  # (2R, H, n, E)
        k = attn.to_k(x).view(rows, n, h, e).transpose(1, 2)
        v = attn.to_v(x).view(rows, n, h, e).transpose(1, 2)
        starts = [c.num_frames for c in self.caches]  # each request's first new frame (prefix + own so far)
        total = max(a + m for a, m in zip(starts, self.lens))
        keys = k.new_zeros(rows, h, total, e)
        values = v.new_zeros(rows, h, total, e)
        bias = q.new_full((rows, 1, n, total), _MASK_BIAS)
        upcast: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        kj = torch.arange(total, device=x.device)
        for r, c in enumerate(self.caches):
            a, m = starts[r], self.lens[r]
            pair = slice(2 * r, 2 * r + 2)  # the request's conditional and unconditional rows
            if len(c.keys) == i:  # first chunk of this request
                c.keys.append(k.new_zeros(2, h, 0, e, dtype=self.cache_dtype or k.dtype))
                c.values.append(v.new_zeros(2, h, 0, e, dtype=self.cache_dtype or v.dtype))
            p = 0
            if c.prefix is not None:
                shared = upcast.get(id(c.prefix))
                if shared is None:
                    shared = upcast[id(c.prefix)] = (c.prefix.keys[i].to(k.dtype), c.prefix.values[i].to(v.dtype))
                p = shared[0].shape[2]
                keys[pair, :, :p], values[pair, :, :p] = shared
            keys[pair, :, p:a] = c.keys[i]
            values[pair, :, p:a] = c.values[i]
            k_new, v_new = k[pair, :, :m], v[pair, :, :m]
            keys[pair, :, a : a + m] = k_new
            values[pair, :, a : a + m] = v_new
            qi = torch.arange(a, a + m, device=x.device)
            limit = torch.clamp((qi // self.chunk + 1) * self.chunk, max=a + m)  # block end, within the row
            bias[pair, 0, :m] = torch.where(kj[None, :] < limit[:, None], 0.0, _MASK_BIAS).to(q.dtype)
            if self.keeps[r]:  # own frames only; a reduced dtype is for storage: this chunk attended at full
                store = self.cache_dtype or k.dtype
                c.keys[i] = torch.cat([c.keys[i], k_new.to(store)], dim=2)
                c.values[i] = torch.cat([c.values[i], v_new.to(store)], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias)  # (2R, H, n, E)
        out = out.transpose(1, 2).reshape(rows, n, h * e)  # (2R, n, H*E)
        return attn.to_out[1](attn.to_out[0](out))


def _block(run: _ChunkRun, block: CausalBlock1D, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    conv, _, norm, _, act = block.block
    y = run.conv(conv, x * mask)
    y = norm(y.transpose(1, 2)).transpose(1, 2)
    return act(y) * mask


def _resnet(run: _ChunkRun, resnet: CausalResnetBlock1D, x: torch.Tensor, mask: torch.Tensor,
            temb: torch.Tensor) -> torch.Tensor:
    h = _block(run, resnet.block1, x, mask)
    h = h + resnet.mlp(temb).unsqueeze(-1)
    h = _block(run, resnet.block2, h, mask)
    return h + resnet.res_conv(x * mask)


def _transformers(run: _ChunkRun, blocks: nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
    x = h.transpose(1, 2)  # (2R, n, D)
    for block in blocks:
        x = x + run.attention(block.attn1, block.norm1(x))
        x = x + block.ff(block.norm3(x))
    return x.transpose(1, 2)


def estimator_chunk(
    est: CausalConditionalDecoder,
    x: torch.Tensor,
    mask: torch.Tensor,
    mu: torch.Tensor,
    t: torch.Tensor,
    spks: torch.Tensor,
    cond: torch.Tensor,
    run: _ChunkRun,
) -> torch.Tensor:
    """The estimator's streaming forward on new frames: x, mu, cond (2R, 80, n), mask (2R, 1, n), t (2R,),
    spks (2R, 80) -> velocity (2R, 80, n)."""
    temb = est.time_mlp(est.time_embeddings(t).to(t.dtype))  # (2R, 4D)
    spk_map = spks.unsqueeze(-1).expand(-1, -1, x.shape[-1])
    h = torch.cat([x, mu, spk_map, cond], dim=1)  # (2R, 320, n)
    skips = []
    for resnet, blocks, downsample in est.down_blocks:
        h = _transformers(run, blocks, _resnet(run, resnet, h, mask, temb))
        skips.append(h)
        h = run.conv(downsample, h * mask)
    for resnet, blocks in est.mid_blocks:
        h = _transformers(run, blocks, _resnet(run, resnet, h, mask, temb))
    for resnet, blocks, upsample in est.up_blocks:
        skip = skips.pop()
        h = torch.cat([h[:, :, : skip.shape[-1]], skip], dim=1)  # (2R, 2D, n)
        h = _transformers(run, blocks, _resnet(run, resnet, h, mask, temb))
        h = run.conv(upsample, h * mask)
    h = _block(run, est.final_block, h, mask)
    return est.final_proj(h * mask) * mask


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
) -> torch.Tensor:
    """Euler + CFG on new frames. mu, cond (R, 80, n), spks (R, 80); row r covers absolute frames
    [starts[r], starts[r] + lens[r]); caches[r] holds one `EstimatorCache` per Euler step (created on first use)
    and is extended when keeps[r] (a cached chunk must end on a block boundary); cache_dtype stores the cached
    keys/values reduced (e.g. bf16: half the memory, upcast when read).
    Returns mel (R, 80, n) float32 (zeros on padding)."""
    num, _, n = mu.shape
    dev, dtype = mu.device, mu.dtype
    noise = cfm.rand_noise
    z = torch.zeros(num, mu.shape[1], n, dtype=dtype, device=dev)
    mask = torch.zeros(num, 1, n, dtype=dtype, device=dev)
    for r, (s, m) in enumerate(zip(starts, lens)):
        if s + m > noise.shape[-1]:
            raise InputError(
                f"{s + m} mel frames exceed the fixed flow noise ({noise.shape[-1]} frames); synthesise shorter segments"
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
    cfg = cfm.config.inference_cfg_rate
    # rows request-major: (conditional, unconditional) of request 0, then of request 1, ... so a request's pair
    # is a slice (a view) for the caches
    mask_in = mask.repeat_interleave(2, dim=0)  # (2R, 1, n)
    mu_in = torch.stack([mu, torch.zeros_like(mu)], dim=1).flatten(0, 1)
    spks_in = torch.stack([spks, torch.zeros_like(spks)], dim=1).flatten(0, 1)
    cond_in = torch.stack([cond, torch.zeros_like(cond)], dim=1).flatten(0, 1)
    t_span = cosine_time_grid(n_timesteps, dtype, dev)
    x = z
    t = t_span[0]
    dt = t_span[1] - t_span[0]
    for step in range(1, len(t_span)):
        run = _ChunkRun([per_step[step - 1] for per_step in caches], lens, keeps, chunk, cache_dtype)
        v = estimator_chunk(estimator, x.repeat_interleave(2, dim=0), mask_in, mu_in, t.expand(2 * num), spks_in,
                            cond_in, run).view(num, 2, *x.shape[1:])
        x = x + dt * ((1.0 + cfg) * v[:, 0] - cfg * v[:, 1])
        t = t + dt
        if step < len(t_span) - 1:
            dt = t_span[step + 1] - t
    for r, per_step in enumerate(caches):
        if keeps[r]:
            for c in per_step:
                c.num_frames = starts[r] + lens[r]
    return (x * mask).float()
