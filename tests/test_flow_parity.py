"""Flow (`CausalMaskedDiffWithXvec`) against the official module's recorded outputs (compat folder, set A),
plus streaming causality of the encoder and a smoke test of the training objective."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import load_reference
from vocalis.config import CFMConfig, EstimatorConfig, FlowConfig, FlowEncoderConfig, tiny_config
from vocalis.models.flow.encoder import UpsampleConformerEncoder

ATOL = 1e-4


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module")
def flow_state(compat_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(compat_dir / "flow.pt", weights_only=True)


@pytest.fixture(scope="module")
def ref(compat_dir: Path) -> dict[str, torch.Tensor]:
    return load_reference(compat_dir, "ref_flow")


@pytest.fixture(scope="module")
def encoder(flow_state: dict[str, torch.Tensor], compat_model) -> UpsampleConformerEncoder:
    enc = UpsampleConformerEncoder(compat_model.config.flow.encoder).eval()
    prefix = "encoder."
    enc.load_state_dict({k[len(prefix) :]: v for k, v in flow_state.items() if k.startswith(prefix)}, strict=True)
    return enc


@pytest.fixture(scope="module")
def flow(compat_model):
    return compat_model.flow  # loaded by the official-layout loader


def _embed(flow_state: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    return F.embedding(tokens.long(), flow_state["input_embedding.weight"])  # (1, Tt, 512)


# --- encoder alone (needs no CFM) -------------------------------------------------------------------------


def test_encoder_keys_match_checkpoint(
    encoder: UpsampleConformerEncoder, flow_state: dict[str, torch.Tensor]
) -> None:
    ours = {k: tuple(v.shape) for k, v in encoder.state_dict().items()}
    theirs = {k[len("encoder.") :]: tuple(v.shape) for k, v in flow_state.items() if k.startswith("encoder.")}
    assert ours == theirs


def test_mu_matches_reference(
    encoder: UpsampleConformerEncoder, flow_state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]
) -> None:
    tokens = torch.cat([ref["prompt_token"], ref["token"]], dim=1)  # (1, 45)
    with torch.no_grad():
        h, mask = encoder(_embed(flow_state, tokens), torch.tensor([tokens.size(1)], dtype=torch.int32))
        mu = F.linear(h, flow_state["encoder_proj.weight"], flow_state["encoder_proj.bias"])
    assert mask.shape == (1, 1, 90) and bool(mask.all())
    diff = _max_diff(mu, ref["mu"])
    print(f"mu max abs diff {diff:.3g}")
    assert diff <= ATOL


def test_encoder_streaming_is_chunk_causal(
    encoder: UpsampleConformerEncoder, flow_state: dict[str, torch.Tensor]
) -> None:
    """Streaming output for the first k chunks is unchanged when later tokens are appended."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 100, (1, 80), generator=gen)
    x = _embed(flow_state, tokens)
    lookahead = encoder.config.pre_lookahead_len
    ratio = encoder.config.up_stride
    with torch.no_grad():
        full, _ = encoder(x, torch.tensor([80]), streaming=True)
        for k in (1, 2):
            n = k * encoder.config.static_chunk_size
            context = x[:, n : n + lookahead]
            prefix, _ = encoder(x[:, :n], torch.tensor([n + lookahead]), context=context, streaming=True)
            assert prefix.shape[1] == ratio * n
            diff = _max_diff(prefix, full[:, : ratio * n])
            print(f"streaming prefix of {k} chunk(s) vs longer input: max abs diff {diff:.3g}")
            assert diff <= 1e-5
        # Without chunk masks the prefix does see the appended tokens.
        offline, _ = encoder(x, torch.tensor([80]), streaming=False)
        assert _max_diff(offline[:, :50], full[:, :50]) > 1e-3


def test_encoder_padding_does_not_leak(
    encoder: UpsampleConformerEncoder, flow_state: dict[str, torch.Tensor]
) -> None:
    """A padded row equals the same row run alone, on its valid frames (attention ignores padded keys)."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 100, (2, 30), generator=gen)
    x = _embed(flow_state, tokens)
    with torch.no_grad():
        # Zero the padding as the flow's embedding mask does; the look-ahead conv reads it as right padding.
        x_padded = x.clone()
        x_padded[1, 20:] = 0
        batch, mask = encoder(x_padded, torch.tensor([30, 20]))
        alone, _ = encoder(x[1:, :20], torch.tensor([20]))
    assert mask[1, 0].sum().item() == 40
    assert _max_diff(batch[1:, :40], alone) <= 1e-5


# --- whole flow (needs the CFM and estimator) --------------------------------------------------------------


def test_flow_strict_load_all_keys(flow, flow_state: dict[str, torch.Tensor]) -> None:
    ours = {k: tuple(v.shape) for k, v in flow.state_dict().items()}
    assert ours == {k: tuple(v.shape) for k, v in flow_state.items()}
    assert any(k.startswith("decoder.estimator.") for k in ours)


def test_spks_projected(flow, ref: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        spks = flow.speaker_projection(ref["embedding"])
    diff = _max_diff(spks, ref["spks_projected"])
    print(f"spks_projected max abs diff {diff:.3g}")
    assert diff <= ATOL


def _inference(
    flow, ref: dict[str, torch.Tensor], streaming: bool, finalize: bool, prompt: bool = True
) -> torch.Tensor:
    token = ref["token"]
    if prompt:
        prompt_token, prompt_feat = ref["prompt_token"], ref["prompt_feat"]
    else:
        prompt_token = torch.zeros(1, 0, dtype=torch.int32)
        prompt_feat = torch.zeros(1, 0, 80)
    as_len = lambda n: torch.tensor([n], dtype=torch.int32)  # noqa: E731
    return flow.inference(
        token,
        as_len(token.size(1)),
        prompt_token,
        as_len(prompt_token.size(1)),
        prompt_feat,
        as_len(prompt_feat.size(1)),
        ref["embedding"],
        streaming=streaming,
        finalize=finalize,
    )


@pytest.mark.parametrize(
    ("key", "streaming", "finalize", "prompt"),
    [
        ("mel", False, True, True),
        ("mel_streaming_finalize", True, True, True),
        ("mel_streaming_chunk_lookahead", True, False, True),
        ("mel_noprompt", False, True, False),
    ],
)
def test_flow_inference_matches_reference(
    flow, ref: dict[str, torch.Tensor], key: str, streaming: bool, finalize: bool, prompt: bool
) -> None:
    mel = _inference(flow, ref, streaming, finalize, prompt)
    diff = _max_diff(mel, ref[key])
    print(f"{key} max abs diff {diff:.3g}")
    assert diff <= ATOL


def test_flow_mu_matches_reference(flow, ref: dict[str, torch.Tensor]) -> None:
    tokens = torch.cat([ref["prompt_token"], ref["token"]], dim=1)
    with torch.no_grad():
        mu, _ = flow.encode(tokens, torch.tensor([tokens.size(1)], dtype=torch.int32))
    assert _max_diff(mu, ref["mu"]) <= ATOL


def test_training_loss_is_finite_reproducible_and_trains_both_modes() -> None:
    pytest.importorskip("vocalis.models.flow.cfm")
    from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
    from vocalis.models.flow.flow_train import flow_matching_loss

    config = FlowConfig(
        vocab_size=50,
        input_size=32,
        encoder=FlowEncoderConfig(
            input_size=32, output_size=32, attention_heads=2, linear_units=32, num_blocks=1, num_up_blocks=1
        ),
        estimator=EstimatorConfig(channels=(16,), attention_head_dim=8, n_blocks=1, num_mid_blocks=1, num_heads=2),
        cfm=CFMConfig(noise_frames=200),
    )
    torch.manual_seed(0)
    flow = CausalMaskedDiffWithXvec(config).train()
    gen = torch.Generator().manual_seed(3)
    token = torch.randint(0, 50, (2, 30), generator=gen)
    token_len = torch.tensor([30, 22])
    feat = torch.randn(2, 60, 80, generator=gen)
    feat_len = 2 * token_len
    embedding = torch.randn(2, 192, generator=gen)
    flow.eval()  # dropout off, so two runs with the same generator seed agree exactly
    losses = []
    for streaming in (True, False):
        for _ in range(2):
            loss = flow_matching_loss(
                flow, token, token_len, feat, feat_len, embedding, torch.Generator().manual_seed(7), streaming
            )
            losses.append(loss)
    assert all(torch.isfinite(x) for x in losses)
    assert losses[0].item() == losses[1].item() and losses[2].item() == losses[3].item()
    assert losses[0].item() != losses[2].item()
    flow.train()
    loss = flow_matching_loss(flow, token, token_len, feat, feat_len, embedding, torch.Generator().manual_seed(7))
    loss.backward()
    grads = [p.grad for p in flow.parameters() if p.requires_grad]
    assert flow.input_embedding.weight.grad is not None and flow.input_embedding.weight.grad.abs().sum() > 0
    assert sum(g is None for g in grads) == 0


def test_flow_loss_excludes_prompt_frames_by_default() -> None:
    from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
    from vocalis.models.flow.flow_train import flow_matching_loss, random_prompt_condition

    torch.manual_seed(0)
    flow = CausalMaskedDiffWithXvec(tiny_config().flow).eval()
    gen = torch.Generator().manual_seed(3)
    token = torch.randint(0, 50, (2, 30), generator=gen)
    token_len = torch.tensor([30, 30])
    feat = torch.randn(2, 60, 80, generator=gen)
    embedding = torch.randn(2, 192, generator=gen)
    seed = next(s for s in range(100) if any(random_prompt_condition(feat, 2 * token_len,
                                                                     torch.Generator().manual_seed(s))[1]))

    def loss(exclude: bool) -> float:
        return flow_matching_loss(flow, token, token_len, feat, 2 * token_len, embedding,
                                  torch.Generator().manual_seed(seed), False, exclude_prompt=exclude).item()

    # the same draws, the same prediction: only which frames are counted differs
    assert loss(True) != loss(False)
    cond, lens = random_prompt_condition(feat, 2 * token_len, torch.Generator().manual_seed(seed))
    assert any(lens) and all(torch.equal(cond[i, :n], feat[i, :n]) for i, n in enumerate(lens))
