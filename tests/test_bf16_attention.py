"""Our bf16 attention (`vocalis.kernels.bf16_attention`: the tile kernel on AMX CPUs, the dot-product one on
AVX512-BF16 CPUs; each test runs every kernel this CPU has) against float64 math on the same bf16 inputs:
per-query key limits (block-causal and padding masks), queries with no visible key, both output layouts,
strided q/k/v (views of one fused projection, as the estimator passes them), head sizes 8, 32 and 64, and the
estimator's masks given as additive biases (`limits_of`).

Bounds: output within 2^-7 of max |v| (weights rounded to bf16 before p v: ~2^-9 each, plus the output's own
rounding) [measured ~2^-9]; log-sum-exp within 1e-4 [~5e-7]."""

from __future__ import annotations

import pytest
import torch
from attention_support import exact_attention

from vocalis.kernels import bf16_attention

pytestmark = pytest.mark.skipif(not bf16_attention.supports(torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16)),
                                reason="our bf16 attention runs on AMX or AVX512-BF16 CPUs (native extension built)")
KERNELS = [pytest.param(k, marks=pytest.mark.skipif(k not in bf16_attention.kernels(), reason=f"no {k} kernel here"))
           for k in bf16_attention.KERNELS]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("heads_first", [True, False])
@pytest.mark.parametrize(("B", "H", "n", "L", "E"), [(2, 8, 100, 200, 64), (4, 2, 37, 333, 8), (1, 1, 1, 5, 64),
                                                     (2, 4, 250, 250, 32), (3, 2, 70, 70, 48)])
def test_againstexact_attention(B: int, H: int, n: int, L: int, E: int, heads_first: bool, kernel: str) -> None:
    g = torch.Generator().manual_seed(B * n + L)
    qkv = torch.randn(B, n, 3, H, E, generator=g).bfloat16()  # a fused projection's output, as the estimator's
    q = qkv[:, :, 0].transpose(1, 2)  # (B, H, n, E), strided
    k = torch.randn(B, H, L + 3, E, generator=g).bfloat16()[:, :, 3:]  # offset rows
    v = torch.randn(B, H, L, E, generator=g).bfloat16()
    limits = torch.randint(0, L + 1, (B, n), generator=g, dtype=torch.int32)
    limits[0, 0] = 0  # a query that sees no key
    out, lse = bf16_attention.attend(q, k, v, limits, heads_first=heads_first, which=kernel)
    want, want_lse = exact_attention(q, k, v, limits)
    got = out if heads_first else out.transpose(1, 2)
    assert out.is_contiguous() and got.shape == (B, H, n, E)
    assert (got.double() - want).abs().max().item() <= 2**-7 * v.abs().max().item()
    assert (lse.double() - want_lse).abs().max().item() <= 1e-4
    assert (got[0, :, 0] == 0).all() and (lse[0, :, 0] == -1e10).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_all_visible_and_shared_limits(kernel: str) -> None:
    """No limits = every key visible; one row of limits (1, n) applies to every batch row."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(3, 2, 20, 64, generator=g).bfloat16() for _ in range(3))
    out, _ = bf16_attention.attend(q, k, v, None, which=kernel)
    want, _ = exact_attention(q, k, v, torch.full((3, 20), 20, dtype=torch.int32))
    assert (out.double() - want).abs().max().item() <= 2**-7 * v.abs().max().item()
    shared = torch.arange(1, 21, dtype=torch.int32)[None]
    out, _ = bf16_attention.attend(q, k, v, shared, which=kernel)
    want, _ = exact_attention(q, k, v, shared.expand(3, -1))
    assert (out.double() - want).abs().max().item() <= 2**-7 * v.abs().max().item()


def test_limits_of_block_causal_bias() -> None:
    """The estimator's block-causal bias (queries at frames 100-199 in blocks of 50 over 200 keys) as limits."""
    qi = torch.arange(100, 200)
    limit = (qi // 50 + 1) * 50
    bias = torch.where(torch.arange(200)[None] < limit[:, None], 0.0, -1e10)[None, None]  # (1, 1, n, L)
    assert torch.equal(bf16_attention.limits_of(bias), limit[None].int())


@pytest.mark.parametrize("kernel", KERNELS)
def test_key_pieces_equal_one_sequence(kernel: str) -> None:
    """Keys/values given as pieces (a prefix with 2 batch rows shared by request pairs, then per-row pieces, one
    of them strided) equal the same keys laid out as one sequence."""
    g = torch.Generator().manual_seed(11)
    B, H, n, E = 6, 2, 9, 64
    q = torch.randn(B, H, n, E, generator=g).bfloat16()
    prefix_k, prefix_v = (torch.randn(2, H, 13, E, generator=g).bfloat16() for _ in range(2))
    own_k, own_v = (torch.randn(B, H, 7, E, generator=g).bfloat16() for _ in range(2))
    new = torch.randn(B, n, 2, H, E, generator=g).bfloat16()
    new_k, new_v = new[:, :, 0].transpose(1, 2), new[:, :, 1].transpose(1, 2)  # strided views
    limits = torch.randint(1, 13 + 7 + n + 1, (B, n), generator=g, dtype=torch.int32)
    out, lse = bf16_attention.attend(q, [prefix_k, own_k, new_k], [prefix_v, own_v, new_v], limits, which=kernel)
    whole_k = torch.cat([prefix_k.repeat(B // 2, 1, 1, 1), own_k, new_k], dim=2)
    whole_v = torch.cat([prefix_v.repeat(B // 2, 1, 1, 1), own_v, new_v], dim=2)
    want, want_lse = bf16_attention.attend(q, whole_k, whole_v, limits, which=kernel)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


def test_native_false_takes_torchs_kernel() -> None:
    """The estimator's `attend` with native=False (`Token2WavConfig.native_kernels` off) runs torch's CPU attention
    kernel on the same bf16 inputs, not ours; by default ours."""
    from vocalis.token2wav.cv2.attention import attend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 10, 64, generator=g).bfloat16() for _ in range(3))
    out, lse = attend(q, k, v, None, native=False)
    torch_out, torch_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    assert torch.equal(out, torch_out) and torch.equal(lse, torch_lse)
    ours, ours_lse = bf16_attention.attend(q, k, v, None, True)
    default_out, default_lse = attend(q, k, v, None)
    assert torch.equal(default_out, ours) and torch.equal(default_lse, ours_lse)


def test_an_absent_kernel_is_refused() -> None:
    """Asking for a kernel this CPU does not run is a clear error, not a crash in the extension."""
    absent = [k for k in bf16_attention.KERNELS if k not in bf16_attention.kernels()]
    q = torch.zeros(1, 1, 4, 64, dtype=torch.bfloat16)
    for which in [*absent, "nonsense"]:
        with pytest.raises(ValueError, match="does not run here"):
            bf16_attention.attend(q, q, q, None, which=which)
