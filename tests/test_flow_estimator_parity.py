"""Flow decoder: the estimator and CFM against the official recordings (ref_flow), plus batching and causality."""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from pathlib import Path

import pytest
import torch

from conftest import load_reference
from vocalis.config import CFMConfig, EstimatorConfig, tiny_config
from vocalis.models.flow.cfm import CausalConditionalCFM, fixed_noise
from vocalis.models.flow.estimator import CausalConditionalDecoder

ATOL = 1e-4
NOISE_SHA256 = "584a26e6eaad944407a96c5999aaa5cd0a6a359309a841eade68bf805c072322"
ESTIMATOR_INPUTS = ("x", "mask", "mu", "t", "spks", "cond")
TINY_FLOW = tiny_config().flow


def _sub_state_dict(compat_dir: Path, prefix: str) -> dict[str, torch.Tensor]:
    state = torch.load(compat_dir / "flow.pt", weights_only=True, mmap=True)
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _report(name: str, diff: float) -> None:
    print(f"{name}: max abs diff {diff:.3e}")


@pytest.fixture(scope="module")
def ref_flow(compat_dir: Path) -> dict[str, torch.Tensor]:
    return load_reference(compat_dir, "ref_flow")


@pytest.fixture(scope="module")
def compat_cfm(compat_dir: Path) -> CausalConditionalCFM:
    cfm = CausalConditionalCFM(TINY_FLOW.cfm, TINY_FLOW.estimator).eval()
    cfm.load_state_dict(_sub_state_dict(compat_dir, "decoder."), strict=True)
    return cfm


def test_estimator_strict_load_keys_and_shapes(compat_dir: Path) -> None:
    sub = _sub_state_dict(compat_dir, "decoder.estimator.")
    est = CausalConditionalDecoder(TINY_FLOW.estimator)
    ours = {k: tuple(v.shape) for k, v in est.state_dict().items()}
    assert ours == {k: tuple(v.shape) for k, v in sub.items()}
    est.load_state_dict(sub, strict=True)
    # The CFM wrapper adds nothing to the state_dict: its fixed noise is not persistent.
    cfm = CausalConditionalCFM(TINY_FLOW.cfm, TINY_FLOW.estimator)
    assert set(cfm.state_dict()) == {f"estimator.{k}" for k in sub}


@pytest.mark.parametrize("streaming", [False, True])
def test_estimator_matches_official(
    compat_cfm: CausalConditionalCFM, ref_flow: dict[str, torch.Tensor], streaming: bool
) -> None:
    args = [ref_flow[f"estimator_in_{k}"] for k in ESTIMATOR_INPUTS]
    expected = ref_flow["estimator_out_streaming" if streaming else "estimator_out"]
    with torch.no_grad():
        out = compat_cfm.estimator(*args, streaming=streaming)
    diff = (out - expected).abs().max().item()
    _report(f"estimator streaming={streaming}", diff)
    assert out.shape == expected.shape
    assert diff <= ATOL


def test_fixed_noise_matches_official(ref_flow: dict[str, torch.Tensor]) -> None:
    rng_before = torch.random.get_rng_state()
    noise = fixed_noise(80, CFMConfig().noise_frames, CFMConfig().noise_seed)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "the global RNG must not be touched"
    assert noise.shape == (1, 80, 15000) and noise.dtype == torch.float32
    digest = hashlib.sha256(noise.numpy().astype("<f4").tobytes()).hexdigest()
    assert digest == NOISE_SHA256
    diff = (noise[:, :, :90] - ref_flow["noise"]).abs().max().item()
    _report("noise[:90]", diff)
    assert diff == 0.0


def test_cfm_decode_matches_official_mel(compat_cfm: CausalConditionalCFM, ref_flow: dict[str, torch.Tensor]) -> None:
    # The official decoder input of flow.inference(streaming=False): mu and the prompt-mel condition.
    mu = ref_flow["mu"].transpose(1, 2)  # (1, 80, 90)
    prompt = ref_flow["prompt_feat"].transpose(1, 2)  # (1, 80, 10)
    cond = torch.zeros_like(mu)
    cond[:, :, : prompt.shape[-1]] = prompt
    mask = torch.ones(1, 1, mu.shape[-1])
    mel = compat_cfm(mu, mask, ref_flow["spks_projected"], cond, n_timesteps=10)
    mel = mel[:, :, prompt.shape[-1] :]
    diff = (mel - ref_flow["mel"]).abs().max().item()
    _report("cfm mel (10 Euler steps)", diff)
    assert diff <= ATOL


def _random_cfm(seed: int = 0) -> CausalConditionalCFM:
    torch.manual_seed(seed)
    cfm = CausalConditionalCFM(TINY_FLOW.cfm, TINY_FLOW.estimator).eval()
    # Default init leaves LayerNorms at identity and some paths near zero; perturb so every path matters.
    with torch.no_grad():
        for p in cfm.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return cfm


def _request(gen: torch.Generator, frames: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mu = torch.randn(1, 80, frames, generator=gen)
    spks = torch.randn(1, 80, generator=gen)
    cond = torch.zeros(1, 80, frames)
    cond[:, :, :7] = torch.randn(1, 80, 7, generator=gen)
    return mu, spks, cond


@pytest.mark.parametrize("streaming", [False, True])
def test_cfm_batched_equals_alone(streaming: bool) -> None:
    cfm = _random_cfm()
    gen = torch.Generator().manual_seed(7)
    lengths = (70, 53)  # different lengths: the second is right-padded in the batch
    reqs = [_request(gen, n) for n in lengths]
    t_max = max(lengths)
    mu = torch.zeros(2, 80, t_max)
    cond = torch.zeros(2, 80, t_max)
    mask = torch.zeros(2, 1, t_max)
    for i, (n, (m, _, c)) in enumerate(zip(lengths, reqs, strict=True)):
        mu[i, :, :n], cond[i, :, :n], mask[i, :, :n] = m[0], c[0], 1.0
    spks = torch.cat([s for _, s, _ in reqs], dim=0)
    batched = cfm(mu, mask, spks, cond, n_timesteps=4, streaming=streaming)
    worst = 0.0
    for i, (n, (m, s, c)) in enumerate(zip(lengths, reqs, strict=True)):
        alone = cfm(m, torch.ones(1, 1, n), s, c, n_timesteps=4, streaming=streaming)
        worst = max(worst, (batched[i : i + 1, :, :n] - alone).abs().max().item())
    _report(f"batched vs alone streaming={streaming}", worst)
    assert worst <= 1e-5


def test_streaming_estimator_is_block_causal() -> None:
    est = _random_cfm().estimator
    chunk = est.static_chunk_size
    gen = torch.Generator().manual_seed(3)
    t = 2 * chunk + 10
    x, mu, cond = (torch.randn(1, 80, t, generator=gen) for _ in range(3))
    spks = torch.randn(1, 80, generator=gen)
    mask = torch.ones(1, 1, t)
    tt = torch.tensor([0.4])
    x2, mu2, cond2 = x.clone(), mu.clone(), cond.clone()
    for a in (x2, mu2, cond2):  # change everything after the first chunk
        a[:, :, chunk:] += torch.randn(1, 80, t - chunk, generator=gen)
    with torch.no_grad():
        out = est(x, mask, mu, tt, spks, cond, streaming=True)
        out2 = est(x2, mask, mu2, tt, spks, cond2, streaming=True)
        full = est(x, mask, mu, tt, spks, cond, streaming=False)
        full2 = est(x2, mask, mu2, tt, spks, cond2, streaming=False)
    assert (out[:, :, :chunk] - out2[:, :, :chunk]).abs().max().item() == 0.0
    assert (out[:, :, chunk:] - out2[:, :, chunk:]).abs().max().item() > 1e-3
    # Full attention lets later frames reach the first chunk: the check above is not vacuous.
    assert (full[:, :, :chunk] - full2[:, :, :chunk]).abs().max().item() > 1e-3


def test_compute_loss_reproducible_and_trainable() -> None:
    cfm = _random_cfm().train()
    gen = torch.Generator().manual_seed(11)
    x1, mu, cond = (torch.randn(3, 80, 40, generator=gen) for _ in range(3))
    spks = torch.randn(3, 80, generator=gen)
    mask = torch.ones(3, 1, 40)
    mask[2, :, 30:] = 0.0
    loss_a = cfm.compute_loss(x1, mask, mu, spks, cond, streaming=True, generator=torch.Generator().manual_seed(5))
    loss_b = cfm.compute_loss(x1, mask, mu, spks, cond, streaming=True, generator=torch.Generator().manual_seed(5))
    assert loss_a.ndim == 0 and torch.isfinite(loss_a)
    assert loss_a.item() == loss_b.item()
    loss_a.backward()
    assert cfm.estimator.final_proj.weight.grad is not None

    # Re-derive the loss by hand from the same draws (t, noise, guidance dropout, in that order).
    cfm.zero_grad()
    g = torch.Generator().manual_seed(5)
    t = 1 - torch.cos(torch.rand((3, 1, 1), generator=g) * 0.5 * torch.pi)
    x0 = torch.randn(x1.shape, generator=g)
    keep = (torch.rand((3,), generator=g) > cfm.config.training_cfg_rate).float()
    sigma = cfm.config.sigma_min
    y = (1 - (1 - sigma) * t) * x0 + t * x1
    u = x1 - (1 - sigma) * x0
    with torch.no_grad():
        pred = cfm.estimator(
            y, mask, mu * keep.view(-1, 1, 1), t.view(3), spks * keep.view(-1, 1), cond * keep.view(-1, 1, 1), True
        )
    manual = (((pred - u) * mask) ** 2).sum() / (mask.sum() * 80)
    assert abs(manual.item() - loss_a.item()) <= 1e-6 * max(1.0, manual.item())


def test_estimator_onnx_export_dynamic_length(tmp_path: Path) -> None:
    """The TRT path exports the non-streaming estimator to ONNX with a dynamic frame axis (batch 2)."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    cfg = dataclasses.replace(
        EstimatorConfig(), channels=(16,), attention_head_dim=4, n_blocks=1, num_mid_blocks=1, num_heads=2
    )
    est = CausalConditionalDecoder(cfg).eval()
    gen = torch.Generator().manual_seed(0)

    def inputs(t: int) -> tuple[torch.Tensor, ...]:
        return (
            torch.randn(2, 80, t, generator=gen),
            torch.ones(2, 1, t),
            torch.randn(2, 80, t, generator=gen),
            torch.rand(2, generator=gen),
            torch.randn(2, 80, generator=gen),
            torch.randn(2, 80, t, generator=gen),
        )

    path = tmp_path / "estimator.onnx"
    dynamic = {k: {2: "seq_len"} for k in ("x", "mask", "mu", "cond", "estimator_out")}
    with warnings.catch_warnings():  # the legacy exporter's deprecation and tracer notes
        warnings.simplefilter("ignore")
        torch.onnx.export(
            est, inputs(64), str(path), input_names=list(ESTIMATOR_INPUTS), output_names=["estimator_out"],
            opset_version=18, dynamic_axes=dynamic, dynamo=False,
        )  # fmt: skip
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for t in (16, 131):
        args = inputs(t)
        (out,) = session.run(None, {n: a.numpy() for n, a in zip(ESTIMATOR_INPUTS, args, strict=True)})
        with torch.no_grad():
            diff = (torch.from_numpy(out) - est(*args)).abs().max().item()
        _report(f"onnx T={t}", diff)
        assert diff <= ATOL
