"""CosyVoice 3 flow (`CausalMaskedDiffWithDiT` + DiT estimator) vs tensors recorded from the official modules
(compat_cv3 ref_flow, fp32 CPU): speaker projection, pre-lookahead output, mu, start noise, the Euler trajectory,
every `inference` mode with and without a prompt, and the bare estimator call (full and block-causal attention).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from cv3_support import ATOL, cv3_reference, max_diff, state_dict_shapes

from vocalis.models.cv3.flow import CausalMaskedDiffWithDiT

NOISE_SHA256 = "584a26e6eaad944407a96c5999aaa5cd0a6a359309a841eade68bf805c072322"  # fixture README


@pytest.fixture(scope="module")
def ref(cv3_dir: Path) -> dict[str, torch.Tensor]:
    return cv3_reference(cv3_dir, "ref_flow")


@pytest.fixture(scope="module")
def flow(cv3_model) -> CausalMaskedDiffWithDiT:
    return cv3_model.flow


def _args(ref: dict[str, torch.Tensor], prompt: bool) -> tuple[torch.Tensor, ...]:
    token = ref["token"]
    if prompt:
        prompt_token, prompt_feat = ref["prompt_token"], ref["prompt_feat"]
    else:
        prompt_token, prompt_feat = torch.zeros(1, 0, dtype=torch.int32), torch.zeros(1, 0, 80)
    return (token, torch.tensor([token.shape[1]]), prompt_token, torch.tensor([prompt_token.shape[1]]),
            prompt_feat, torch.tensor([prompt_feat.shape[1]]), ref["embedding"])


def test_state_dict_keys_and_shapes(cv3_model, cv3_dir: Path) -> None:
    official = torch.load(cv3_dir / "flow.pt", weights_only=True)
    assert state_dict_shapes(CausalMaskedDiffWithDiT(cv3_model.config.flow).state_dict()) == state_dict_shapes(official)


def test_start_noise_is_the_official_buffer(flow: CausalMaskedDiffWithDiT, ref: dict[str, torch.Tensor]) -> None:
    noise = flow.decoder.rand_noise
    assert hashlib.sha256(noise.contiguous().numpy().astype("<f4").tobytes()).hexdigest() == NOISE_SHA256
    assert torch.equal(noise[:, :, : ref["noise"].shape[2]], ref["noise"])


def test_conditioning(flow: CausalMaskedDiffWithDiT, ref: dict[str, torch.Tensor]) -> None:
    tokens = torch.cat((ref["prompt_token"], ref["token"]), dim=1)
    lens = torch.tensor([tokens.shape[1]])
    with torch.inference_mode():
        spks = flow.speaker_projection(ref["embedding"])
        h = flow.pre_lookahead_layer(flow.input_embedding(tokens.long()))
        n = flow.config.pre_lookahead_len
        emb = flow.input_embedding(tokens.long())
        h_chunk = flow.pre_lookahead_layer(emb[:, :-n], context=emb[:, -n:])
        diffs = [
            max_diff("spks_projected", spks, ref["spks_projected"]),
            max_diff("h_lookahead", h, ref["h_lookahead"]),
            max_diff("mu", flow.encode(tokens, lens).transpose(1, 2), ref["mu"]),
            max_diff("h_lookahead_chunk", h_chunk, ref["h_lookahead_chunk"]),
            max_diff("mu_chunk", flow.encode(tokens, lens, finalize=False).transpose(1, 2), ref["mu_chunk"]),
        ]
    assert max(diffs) <= ATOL


def test_euler_trajectory(flow: CausalMaskedDiffWithDiT, ref: dict[str, torch.Tensor]) -> None:
    seen_x, seen_t = [], []

    def record(_module, args, _kwargs) -> None:
        seen_x.append(args[0][0].clone())  # row 0 of the guidance batch
        seen_t.append(args[3][0].clone())

    handle = flow.estimator.register_forward_pre_hook(record, with_kwargs=True)
    try:
        flow.inference(*_args(ref, prompt=True), streaming=False, finalize=True)
    finally:
        handle.remove()
    assert max_diff("euler_t", torch.stack(seen_t), ref["euler_t"]) <= ATOL
    assert max_diff("euler_x", torch.stack(seen_x), ref["euler_x"]) <= ATOL


@pytest.mark.parametrize(
    ("key", "prompt", "streaming", "finalize"),
    [
        ("mel", True, False, True),
        ("mel_streaming_finalize", True, True, True),
        ("mel_streaming_chunk_lookahead", True, True, False),
        ("mel_noprompt", False, False, True),
        ("mel_noprompt_streaming", False, True, True),
    ],
)
def test_inference(flow: CausalMaskedDiffWithDiT, ref: dict[str, torch.Tensor], key: str, prompt: bool,
                   streaming: bool, finalize: bool) -> None:
    mel = flow.inference(*_args(ref, prompt), streaming=streaming, finalize=finalize)
    assert max_diff(key, mel, ref[key]) <= ATOL


@pytest.mark.parametrize("streaming", [False, True])
def test_bare_estimator(flow: CausalMaskedDiffWithDiT, ref: dict[str, torch.Tensor], streaming: bool) -> None:
    key = "estimator_out_streaming" if streaming else "estimator_out"
    with torch.inference_mode():
        out = flow.estimator(ref["estimator_in_x"], ref["estimator_in_mask"], ref["estimator_in_mu"],
                             ref["estimator_in_t"], ref["estimator_in_spks"], ref["estimator_in_cond"],
                             streaming=streaming)
    assert max_diff(key, out, ref[key]) <= ATOL


def test_streaming_estimator_is_block_causal(flow: CausalMaskedDiffWithDiT, ref: dict[str, torch.Tensor]) -> None:
    """Block-causal attention + causal convs: frames of whole leading 50-frame blocks ignore appended frames."""
    names = ("estimator_in_x", "estimator_in_mask", "estimator_in_mu")
    x, mask, mu = (ref[n] for n in names)
    t, spks, cond = ref["estimator_in_t"], ref["estimator_in_spks"], ref["estimator_in_cond"]
    block = flow.estimator.config.static_chunk_size
    with torch.inference_mode():
        whole = flow.estimator(x, mask, mu, t, spks, cond, streaming=True)
        prefix = flow.estimator(x[..., :block], mask[..., :block], mu[..., :block], t, spks, cond[..., :block],
                                streaming=True)
    assert max_diff("estimator streaming prefix", prefix, whole[..., :block]) <= 1e-5


@pytest.mark.parametrize("streaming", [False, True])
def test_estimator_rows_are_independent(flow: CausalMaskedDiffWithDiT, ref: dict[str, torch.Tensor],
                                        streaming: bool) -> None:
    """A batch of requests padded to one length (mask 0 on the padding) gives each request's frames as alone."""
    x, mu, cond, spks, t = (ref[k] for k in ("estimator_in_x", "estimator_in_mu", "estimator_in_cond",
                                              "estimator_in_spks", "estimator_in_t"))
    short = 77
    mask = torch.ones(2, 1, x.shape[2])
    mask[1, :, short:] = 0
    with torch.inference_mode():
        batched = flow.estimator(x, mask, mu, t, spks, cond, streaming=streaming)
        alone = flow.estimator(x[1:, :, :short], mask[1:, :, :short], mu[1:, :, :short], t[1:], spks[1:],
                               cond[1:, :, :short], streaming=streaming)
        full = flow.estimator(x[:1], mask[:1], mu[:1], t[:1], spks[:1], cond[:1], streaming=streaming)
    assert max_diff("padded row vs alone", batched[1:, :, :short], alone) <= 1e-5
    assert max_diff("full row vs alone", batched[:1], full) <= 1e-5
