"""CosyVoice 3 causal HiFT vs tensors recorded from the official `CausalHiFTGenerator` (compat_cv3 ref_hift).

F0 (float64 predictor), the replayed fixed source tables, sine generator, voicing, excitation, source and speech,
for finalize=True and finalize=False, through `inference` and through `decode` from the recorded source.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from cv3_support import ATOL, cv3_reference, max_diff, state_dict_shapes

from vocalis.models.cv3.hift import CausalHiFTGenerator
from vocalis.models.cv3.source import source_noise_tables

SINE_NOISE_SHA256 = "6487915f8897c9b5177efaccda72e5d2a3c369a9cedfe5f5519f9b328ece9503"  # fixture README


@pytest.fixture(scope="module")
def ref(cv3_dir: Path) -> dict[str, torch.Tensor]:
    return cv3_reference(cv3_dir, "ref_hift")


@pytest.fixture(scope="module")
def hift(cv3_model) -> CausalHiFTGenerator:
    return cv3_model.hift


def test_state_dict_keys_and_shapes(cv3_model, cv3_dir: Path) -> None:
    official = torch.load(cv3_dir / "hift.pt", weights_only=True)
    assert state_dict_shapes(CausalHiFTGenerator(cv3_model.config.hift).state_dict()) == state_dict_shapes(official)


def test_source_tables_replay_the_official_draws(cv3_model, hift: CausalHiFTGenerator,
                                                 ref: dict[str, torch.Tensor]) -> None:
    rand_ini, noise = hift.tables.get(ref["noise_sine_buffer"].shape[1], torch.device("cpu"))
    assert torch.equal(rand_ini, ref["rand_ini"])
    assert torch.equal(noise[:, : ref["noise_sine_buffer"].shape[1]], ref["noise_sine_buffer"])
    f = cv3_model.config.flow
    config = cv3_model.config.hift
    _, whole = source_noise_tables(f.vocab_size, f.input_size, f.spk_embed_dim, f.output_size, config,
                                   config.source_noise_samples)
    assert hashlib.sha256(whole.numpy().astype("<f4").tobytes()).hexdigest() == SINE_NOISE_SHA256


def test_f0(hift: CausalHiFTGenerator, ref: dict[str, torch.Tensor]) -> None:
    with torch.inference_mode():
        f0 = hift.f0(ref["mel"])
        f0_nofinal = hift.f0(ref["mel"], finalize=False)
    assert f0.dtype == torch.float64
    assert max_diff("f0_float64", f0, ref["f0_float64"]) <= ATOL
    assert max_diff("f0", f0.float(), ref["f0"]) <= ATOL
    assert max_diff("f0_nofinal", f0_nofinal.float(), ref["f0_nofinal"]) <= ATOL
    assert next(hift.f0_predictor.parameters()).dtype == torch.float32  # the module itself is not cast


def test_sine_source(hift: CausalHiFTGenerator, ref: dict[str, torch.Tensor]) -> None:
    hop = hift.config.hop_samples
    with torch.inference_mode():
        f0 = torch.repeat_interleave(hift.f0(ref["mel"]).float(), hop, dim=1).unsqueeze(-1)  # (1, N, 1)
        rand_ini, noise = hift.tables.get(f0.shape[1], f0.device)
        sine_waves, uv = hift.m_source.l_sin_gen(f0, rand_ini, noise[:, : f0.shape[1]])
        sine_merge = hift.m_source(f0, rand_ini, noise[:, : f0.shape[1]])
    assert torch.equal(uv, ref["uv"])
    assert max_diff("sine_waves", sine_waves, ref["sine_waves"]) <= ATOL
    assert max_diff("sine_merge", sine_merge, ref["sine_merge"]) <= ATOL


@pytest.mark.parametrize("finalize", [True, False])
def test_inference_and_decode(hift: CausalHiFTGenerator, ref: dict[str, torch.Tensor], finalize: bool) -> None:
    tag = "" if finalize else "_nofinal"
    mel = ref["mel"]
    with torch.inference_mode():
        speech, source = hift.inference(mel, finalize=finalize)
        decoded = hift.decode(mel if finalize else mel[:, :, :-3], ref[f"source{tag}"], finalize=finalize)
    assert max_diff(f"source{tag}", source, ref[f"source{tag}"]) <= ATOL
    assert max_diff(f"speech{tag}", speech, ref[f"speech{tag}"]) <= ATOL
    assert max_diff(f"speech{tag}_from_decode", decoded, ref[f"speech{tag}_from_decode"]) <= ATOL


def test_non_final_call_is_a_prefix_of_the_final_one(hift: CausalHiFTGenerator, ref: dict[str, torch.Tensor]) -> None:
    with torch.inference_mode():
        final, source = hift.inference(ref["mel"], finalize=True)
        partial, partial_source = hift.inference(ref["mel"], finalize=False)
    assert torch.equal(partial_source, source[:, :, : partial_source.shape[2]])
    assert max_diff("non-final vs final speech", partial, final[:, : partial.shape[1]]) <= 1e-6
