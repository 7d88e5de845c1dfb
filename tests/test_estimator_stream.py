"""The incremental estimator's attention against one attention over each request's whole key sequence (random
weights, fp32): the two-part path of batches (shared voice prefix + each request's own frames, merged by
log-sum-exp) and the one-sequence, block-by-block path of a lone request; in bf16, the one-call path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vocalis.models.flow.transformer import SelfAttention
from vocalis.token2wav.cv2.chunk_run import ChunkRun
from vocalis.token2wav.cv2.compute import ComputeWeights
from vocalis.token2wav.cv2.estimator_cache import EstimatorCache

D, H, E, CHUNK = 16, 2, 8, 4  # width, heads, head width, block-causal block (frames)
ATOL = 1e-5
BF16_ATOL = 3e-2  # outputs ~1 in size; bf16 keeps 8 bits [measured max ~1e-2]


def _kv(frames: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, H, frames, E, generator=g), torch.randn(2, H, frames, E, generator=g)


def _one_part(attn: SelfAttention, x: torch.Tensor, r: int, start: int, m: int,
              held: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Request r's output rows (2, m, D): its m new frames attend over all its keys laid out in one sequence
    (prefix, own cached, new) under the block-causal mask counted from frame 0."""
    xr = x[2 * r : 2 * r + 2, :m]
    q, k, v = (f(xr).view(2, m, H, E).transpose(1, 2) for f in (attn.to_q, attn.to_k, attn.to_v))
    keys = torch.cat([*(kv[0] for kv in held), k], dim=2)
    values = torch.cat([*(kv[1] for kv in held), v], dim=2)
    qi = torch.arange(start, start + m)
    limit = torch.clamp((qi // CHUNK + 1) * CHUNK, max=start + m)
    bias = torch.where(torch.arange(start + m)[None, :] < limit[:, None], 0.0, -1.0e10)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias)
    return attn.to_out[0](out.transpose(1, 2).reshape(2, m, H * E))


def _check(specs: list[tuple[str | None, int, int, bool]], n: int, seed: int, bf16: bool = False) -> None:
    """specs: per request (prefix name or None, own cached frames, new frames, keep). bf16: the engine's bf16
    compute with bf16 attention (as on AMX and AVX512-BF16 CPUs: one masked call over each request's whole key
    sequence for a lone request or a uniform batch), against the fp32 attention within bf16's error."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        attn = SelfAttention(D, H, E).eval()
    prefixes = {}
    for name, frames in (("a", 8), ("b", 4)):
        pk, pv = _kv(frames, g)
        prefixes[name] = EstimatorCache([pk], [pv], [], frames)
    caches, held, starts = [], [], []
    for name, own, _, _ in specs:
        ok, ov = _kv(own, g)
        if name is None:
            cache, parts = EstimatorCache([ok], [ov], [], own), [(ok, ov)]
        else:
            pre = prefixes[name]
            cache = EstimatorCache.on_prefix(pre)
            cache.keys, cache.values = [ok], [ov]
            cache.num_frames += own
            parts = [(pre.keys[0], pre.values[0]), (ok, ov)]
        caches.append(cache)
        held.append(parts)
        starts.append(cache.num_frames)
    lens, keeps = [s[2] for s in specs], [s[3] for s in specs]
    x = torch.randn(2 * len(specs), n, D, generator=g)
    compute = None
    if bf16:
        compute = ComputeWeights(torch.bfloat16, packed=False)
        compute.reduced_attention = True  # as on CPUs with our bf16 attention, whatever this one is
    run = ChunkRun(caches, lens, keeps, CHUNK, compute=compute)
    with torch.inference_mode():
        got = run.attention(attn, x, torch.zeros(x.shape)).float()  # zero residual: the attention alone
        for r, (start, m) in enumerate(zip(starts, lens)):
            want = _one_part(attn, x, r, start, m, held[r])
            torch.testing.assert_close(got[2 * r : 2 * r + 2, :m], want, atol=BF16_ATOL if bf16 else ATOL, rtol=0)
            if bf16:
                continue  # the cached keys are bf16 GEMM outputs: the fp32 keys' check below does not apply
            # the caches gained exactly the new frames (own frames only, the prefix untouched)
            own_keys = caches[r].keys[0]
            if keeps[r]:
                k_new = attn.to_k(x[2 * r : 2 * r + 2, :m]).view(2, m, H, E).transpose(1, 2)
                torch.testing.assert_close(own_keys, torch.cat([held[r][-1][0], k_new], dim=2), atol=0, rtol=0)
                assert own_keys.is_contiguous()
            else:
                assert own_keys is held[r][-1][0]


def test_two_part_equals_one_part_mixed_batch() -> None:
    """Several requests sharing prefix a (different own cached and new lengths), one on prefix b, one with no
    prefix at all, one not keeping its frames: each equals one attention over its whole key sequence."""
    _check([("a", 0, 6, True), ("a", 4, 8, True), (None, 8, 5, True), ("a", 8, 3, False), ("b", 4, 8, True)],
           n=8, seed=1)


@pytest.mark.parametrize("own", [0, 4])
def test_two_part_equals_one_part_uniform(own: int) -> None:
    """The whole-batch path: every request on one prefix with the same layout (first chunk, and a later one)."""
    _check([("a", own, 8, True)] * 3, n=8, seed=2 + own)


def test_no_prefix_uniform() -> None:
    """Requests with no prefix at all (own part only), uniform and not."""
    _check([(None, 4, 8, True)] * 2, n=8, seed=5)
    _check([(None, 0, 8, True), (None, 4, 6, True)], n=8, seed=6)


@pytest.mark.parametrize("spec", [("a", 0, 8, True), ("a", 4, 6, True), ("a", 4, 8, False), (None, 0, 8, True),
                                  (None, 4, 5, True), ("b", 0, 3, True)])
def test_lone_request(spec: tuple[str | None, int, int, bool]) -> None:
    """One request (keys laid out once, queries block by block, no mask): first and later chunks, with and
    without a prefix, keeping or not, chunks shorter than a block and crossing blocks."""
    _check([spec], n=spec[2], seed=7 + spec[1] + spec[2])


@pytest.mark.parametrize("specs", [[("a", 0, 8, True)] * 3, [("a", 4, 8, True)] * 3, [("a", 4, 6, True)],
                                   [(None, 4, 5, True)], [("a", 0, 6, True), ("a", 4, 8, True)]])
def test_bf16_attention(specs: list[tuple[str | None, int, int, bool]]) -> None:
    """bf16 attention (one masked call per step for a lone request or a uniform batch; the two-part path for a
    mixed batch) equals the fp32 attention over each request's whole key sequence within bf16's error."""
    _check(specs, n=max(s[2] for s in specs), seed=11 + len(specs), bf16=True)
