"""Our fp32 attention (`vocalis.kernels.fp32_attention`), at this CPU's own level and at the AVX2 level (forced on
CPUs with more: the other source set), against float64 math: per-query key limits (block-causal and padding
masks), queries with no visible key, both output layouts, strided q/k/v, head sizes 8 to 128, keys given in pieces
(fp32 or bf16); and the estimator's `attend` taking it for fp32 inputs there.

Bounds: output within 1e-5 of max |v| and log-sum-exp within 1e-5 (fp32 sums over a few hundred keys, exp to
~1e-7 relative) [measured ~1e-6]."""

from __future__ import annotations

import pytest
import torch
from attention_support import exact_attention

from vocalis.kernels import fp32_attention

pytestmark = pytest.mark.usefixtures("native_level")


@pytest.mark.parametrize("heads_first", [True, False])
@pytest.mark.parametrize(("B", "H", "n", "L", "E"), [(2, 8, 100, 200, 64), (4, 2, 37, 333, 8), (1, 1, 1, 5, 64),
                                                     (2, 4, 250, 250, 32), (3, 2, 70, 70, 48), (1, 2, 17, 40, 128),
                                                     (2, 2, 9, 9, 12)])
def test_againstexact_attention(B: int, H: int, n: int, L: int, E: int, heads_first: bool) -> None:
    g = torch.Generator().manual_seed(B * n + L)
    qkv = torch.randn(B, n, 3, H, E, generator=g)  # a fused projection's output, as the estimator's
    q = qkv[:, :, 0].transpose(1, 2)  # (B, H, n, E), strided
    k = torch.randn(B, H, L + 3, E, generator=g)[:, :, 3:]  # offset rows
    v = torch.randn(B, H, L, E, generator=g)
    limits = torch.randint(0, L + 1, (B, n), generator=g, dtype=torch.int32)
    limits[0, 0] = 0  # a query that sees no key
    out, lse = fp32_attention.attend(q, k, v, limits, heads_first=heads_first)
    want, want_lse = exact_attention(q, k, v, limits)
    got = out if heads_first else out.transpose(1, 2)
    assert out.is_contiguous() and got.shape == (B, H, n, E) and out.dtype == torch.float32
    assert (got.double() - want).abs().max().item() <= 1e-5 * v.abs().max().item()
    assert (lse.double() - want_lse).abs().max().item() <= 1e-5
    assert (got[0, :, 0] == 0).all() and (lse[0, :, 0] == -1e10).all()


def test_all_visible_shared_limits_and_key_pieces() -> None:
    """No limits = every key visible; one row of limits applies to every batch row; keys in pieces (a prefix with
    2 batch rows shared by request pairs, per-row pieces, one strided) equal the same keys as one sequence."""
    g = torch.Generator().manual_seed(11)
    B, H, n, E = 6, 2, 9, 64
    q = torch.randn(B, H, n, E, generator=g)
    prefix_k, prefix_v = (torch.randn(2, H, 13, E, generator=g) for _ in range(2))
    own_k, own_v = (torch.randn(B, H, 7, E, generator=g) for _ in range(2))
    new = torch.randn(B, n, 2, H, E, generator=g)
    new_k, new_v = new[:, :, 0].transpose(1, 2), new[:, :, 1].transpose(1, 2)  # strided views
    whole_k = torch.cat([prefix_k.repeat(B // 2, 1, 1, 1), own_k, new_k], dim=2)
    whole_v = torch.cat([prefix_v.repeat(B // 2, 1, 1, 1), own_v, new_v], dim=2)
    L = whole_k.shape[2]
    out, _ = fp32_attention.attend(q, whole_k, whole_v, None)
    want, _ = exact_attention(q, whole_k, whole_v, torch.full((B, n), L, dtype=torch.int32))
    assert (out.double() - want).abs().max().item() <= 1e-5 * whole_v.abs().max().item()
    shared = torch.arange(1, n + 1, dtype=torch.int32)[None] * 3
    out, _ = fp32_attention.attend(q, whole_k, whole_v, shared)
    want, _ = exact_attention(q, whole_k, whole_v, shared.expand(B, -1))
    assert (out.double() - want).abs().max().item() <= 1e-5 * whole_v.abs().max().item()
    limits = torch.randint(1, L + 1, (B, n), generator=g, dtype=torch.int32)
    out, lse = fp32_attention.attend(q, [prefix_k, own_k, new_k], [prefix_v, own_v, new_v], limits)
    want, want_lse = fp32_attention.attend(q, whole_k, whole_v, limits)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


def test_bf16_key_pieces_equal_their_fp32_upcast() -> None:
    """bf16 pieces (a cache's dtype: a shared prefix, own cached frames) are read as their exact fp32 values:
    the result equals the same pieces upcast first, bit for bit, beside fp32 new keys (a strided view); a head size
    that is not a multiple of 8 takes the scalar tail; mixed key/value dtypes in one piece are refused."""
    g = torch.Generator().manual_seed(12)
    for B, H, n, E in ((4, 8, 50, 64), (2, 2, 7, 12)):
        q = torch.randn(B, H, n, E, generator=g)
        prefix_k, prefix_v = (torch.randn(2, H, 31, E, generator=g).bfloat16() for _ in range(2))
        own_k, own_v = (torch.randn(B, H, 9, E, generator=g).bfloat16() for _ in range(2))
        new = torch.randn(B, n, 2, H, E, generator=g)
        new_k, new_v = new[:, :, 0].transpose(1, 2), new[:, :, 1].transpose(1, 2)
        limits = torch.randint(1, 31 + 9 + n + 1, (B, n), generator=g, dtype=torch.int32)
        out, lse = fp32_attention.attend(q, [prefix_k, own_k, new_k], [prefix_v, own_v, new_v], limits)
        want, want_lse = fp32_attention.attend(q, [prefix_k.float(), own_k.float(), new_k],
                                               [prefix_v.float(), own_v.float(), new_v], limits)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="equal-shaped"):
        fp32_attention.attend(q, [own_k], [own_v.float()], None)


def test_the_estimators_attend_takes_it_for_fp32() -> None:
    """The estimator's `attend` runs fp32 inputs on this kernel (the bias as limits); with
    native=False (`Token2WavConfig.native_kernels` off), torch's fused kernel, within the same bound."""
    from vocalis.kernels import bf16_attention
    from vocalis.token2wav.cv2.attention import attend, runs_native

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 60, 64, generator=g) for _ in range(3))
    limits = ((torch.arange(60) // 25 + 1) * 25).clamp(max=60).int()[None]  # block-causal, blocks of 25
    bias = torch.where(torch.arange(60)[None] < limits[0, :, None], 0.0, -1e10)[None, None]  # (1, 1, n, L)
    assert runs_native(q) and not bf16_attention.supports(q)  # fp32 q: not the bf16 kernels
    assert torch.equal(bf16_attention.limits_of(bias), limits)
    out, lse = attend(q, k, v, bias, limits)
    ours, ours_lse = fp32_attention.attend(q, k, v, limits)
    assert torch.equal(out, ours) and torch.equal(lse, ours_lse)
    torch_out, torch_lse = attend(q, k, v, bias, limits, native=False)
    assert not torch.equal(out, torch_out)
    torch.testing.assert_close(out, torch_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, torch_lse, rtol=0, atol=1e-5)
