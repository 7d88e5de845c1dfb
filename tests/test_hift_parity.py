"""HiFT vocoder vs tensors recorded from the official `HiFTGenerator` (compat fixture, fp32 CPU).

Max abs differences are printed (`pytest -s`) so the measured margins stay visible.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import load_reference
from vocalis.config import HiFTConfig
from vocalis.errors import InputError, ModelLoadError
from vocalis.models.hift.generator import HiFTGenerator, prepare_official_state_dict, remove_weight_norm

ATOL = 1e-4
SINE_SEED = 15  # ref_hift: torch.manual_seed(15) right before hift.inference


def _max_diff(name: str, ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    diff = (ours.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    print(f"[hift parity] {name}: max abs diff {diff:.3e}")
    return diff


@pytest.fixture(scope="module")
def official_sd(compat_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(compat_dir / "hift.pt", weights_only=True)


@pytest.fixture(scope="module")
def ref(compat_dir: Path) -> dict[str, torch.Tensor]:
    return load_reference(compat_dir, "ref_hift")


@pytest.fixture(scope="module")
def config(compat_model) -> HiFTConfig:
    return compat_model.config.hift


def _build(sd: dict[str, torch.Tensor], config: HiFTConfig) -> HiFTGenerator:
    model = HiFTGenerator(config).eval()
    result = model.load_state_dict(prepare_official_state_dict(sd, model), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return model


@pytest.fixture(scope="module")
def hift(compat_model) -> HiFTGenerator:
    return compat_model.hift  # loaded by the official-layout loader


def test_strict_load_keys_and_shapes(official_sd: dict[str, torch.Tensor], config: HiFTConfig) -> None:
    model = HiFTGenerator(config)
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in official_sd.items()}
    assert ours == theirs
    assert len(ours) == 328


def test_released_size_key_and_parameter_counts() -> None:
    # Architecture doc 1.3 / 9.3: the released hift.pt has 328 keys and 20,821,295 values (g and v counted).
    sd = HiFTGenerator(HiFTConfig()).state_dict()
    assert len(sd) == 328
    assert sum(v.numel() for v in sd.values()) == 20_821_295
    assert tuple(sd["ups.0.parametrizations.weight.original0"].shape) == (512, 1, 1)
    assert tuple(sd["ups.0.parametrizations.weight.original1"].shape) == (512, 256, 16)


def test_f0_predictor(hift: HiFTGenerator, ref: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        f0 = hift.f0_predictor(ref["mel"])
    assert _max_diff("f0", f0, ref["f0"]) <= ATOL


def test_sine_generator_from_recorded_f0(hift: HiFTGenerator, ref: dict[str, torch.Tensor]) -> None:
    f0 = hift.f0_upsamp(ref["f0"][:, None]).transpose(1, 2)  # (1, N, 1)
    torch.manual_seed(SINE_SEED)
    with torch.no_grad():
        sine_waves, uv, noise = hift.m_source.l_sin_gen(f0)
        sine_merge = hift.m_source.l_tanh(hift.m_source.l_linear(sine_waves))
    assert torch.equal(uv, ref["uv"])
    assert _max_diff("sine_waves (recorded f0)", sine_waves, ref["sine_waves"]) <= ATOL
    assert _max_diff("sine_noise (recorded f0)", noise, ref["sine_noise"]) <= ATOL
    assert _max_diff("sine_merge (recorded f0)", sine_merge, ref["sine_merge"]) <= ATOL


def test_inference_seeded(hift: HiFTGenerator, ref: dict[str, torch.Tensor]) -> None:
    mel = ref["mel"]
    with torch.no_grad():
        f0 = hift.f0_predictor(mel)
        f0_up = hift.f0_upsamp(f0[:, None]).transpose(1, 2)
        torch.manual_seed(SINE_SEED)
        sine_waves, uv, _ = hift.m_source.l_sin_gen(f0_up)
    assert torch.equal(uv, ref["uv"])
    assert _max_diff("sine_waves (own f0)", sine_waves, ref["sine_waves"]) <= ATOL

    torch.manual_seed(SINE_SEED)
    speech, source = hift.inference(mel)
    assert _max_diff("source", source, ref["source"]) <= ATOL
    assert _max_diff("speech", speech, ref["speech"]) <= ATOL


def test_decode_from_recorded_source(hift: HiFTGenerator, ref: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        speech = hift.decode(ref["mel"], ref["source"])
    assert _max_diff("speech_from_decode", speech, ref["speech_from_decode"]) <= ATOL


def test_streaming_calls_with_cache_source(hift: HiFTGenerator, compat_dir: Path) -> None:
    # ref_stream: manual_seed(17) once, then only the HiFT calls draw random numbers, in call order.
    stream = load_reference(compat_dir, "ref_stream")
    torch.manual_seed(int(stream["rng_seed"]))
    for k in range(len(stream["call_n_tokens"])):
        speech, source = hift.inference(stream[f"hift_in_mel_{k}"], stream[f"hift_in_cache_source_{k}"])
        assert _max_diff(f"stream source {k}", source, stream[f"hift_out_source_{k}"]) <= ATOL
        assert _max_diff(f"stream speech {k}", speech, stream[f"hift_out_speech_{k}"]) <= ATOL


def _to_legacy(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        k = k.replace(".parametrizations.weight.original0", ".weight_g")
        k = k.replace(".parametrizations.weight.original1", ".weight_v")
        out[k] = v
    return out


@pytest.mark.parametrize("variant", ["legacy_weight_g_v", "generator_prefix", "legacy_and_prefix"])
def test_alternative_key_styles(
    variant: str, official_sd: dict[str, torch.Tensor], hift: HiFTGenerator, ref: dict[str, torch.Tensor],
    config: HiFTConfig,
) -> None:
    sd = _to_legacy(official_sd) if variant.startswith("legacy") else dict(official_sd)
    if variant.endswith("prefix"):
        sd = {f"generator.{k}": v for k, v in sd.items()}
    model = _build(sd, config)
    for key, value in hift.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    with torch.no_grad():
        speech = model.decode(ref["mel"], ref["source"])
    assert _max_diff(f"speech_from_decode ({variant})", speech, ref["speech_from_decode"]) <= ATOL


def test_shape_mismatch_names_key_and_shapes(official_sd: dict[str, torch.Tensor], config: HiFTConfig) -> None:
    sd = dict(official_sd)
    key = "conv_pre.parametrizations.weight.original1"
    sd[key] = torch.zeros(16, 80, 5)
    pattern = r"conv_pre\.parametrizations\.weight\.original1.*\(16, 80, 5\).*\(16, 80, 7\)"
    with pytest.raises(ModelLoadError, match=pattern):
        prepare_official_state_dict(sd, HiFTGenerator(config))


def test_missing_key_raises(official_sd: dict[str, torch.Tensor], config: HiFTConfig) -> None:
    sd = {k: v for k, v in official_sd.items() if k != "conv_post.bias"}
    with pytest.raises(ModelLoadError, match="conv_post.bias"):
        prepare_official_state_dict(sd, HiFTGenerator(config))


def test_remove_weight_norm_keeps_output(
    official_sd: dict[str, torch.Tensor], hift: HiFTGenerator, ref: dict[str, torch.Tensor], config: HiFTConfig
) -> None:
    # A fresh model, not a deepcopy: torch shares the parametrized class between copies, so folding a
    # copy would strip the `weight` property from the original too.
    folded = remove_weight_norm(_build(official_sd, config))
    keys = folded.state_dict().keys()
    assert not any("parametrizations" in k for k in keys)
    assert "conv_pre.weight" in keys and "f0_predictor.condnet.0.weight" in keys
    with torch.no_grad():
        before = hift.decode(ref["mel"], ref["source"])
        after = folded.decode(ref["mel"], ref["source"])
        f0_diff = _max_diff("f0 folded vs parametrized", folded.f0_predictor(ref["mel"]), hift.f0_predictor(ref["mel"]))
    assert _max_diff("decode folded vs parametrized", after, before) <= 1e-5
    assert f0_diff <= 1e-4  # f0 is in Hz (tens), so fp32 rounding of the folded weights shows at ~1e-5


def test_generator_argument_is_independent_of_global_rng(hift: HiFTGenerator, ref: dict[str, torch.Tensor]) -> None:
    mel = ref["mel"]
    torch.manual_seed(0)
    state = torch.get_rng_state()
    speech_a, source_a = hift.inference(mel, generator=torch.Generator().manual_seed(123))
    assert torch.equal(torch.get_rng_state(), state), "a private generator must not touch the global RNG"
    torch.manual_seed(999)
    torch.rand(7)
    speech_b, source_b = hift.inference(mel, generator=torch.Generator().manual_seed(123))
    assert torch.equal(speech_a, speech_b) and torch.equal(source_a, source_b)
    speech_c, _ = hift.inference(mel, generator=torch.Generator().manual_seed(124))
    assert not torch.equal(speech_a, speech_c)
    # A private CPU generator seeded like the reference run reproduces it.
    speech_ref, _ = hift.inference(mel, generator=torch.Generator().manual_seed(SINE_SEED))
    assert _max_diff("speech (private generator, seed 15)", speech_ref, ref["speech"]) <= ATOL


def test_cache_source_replaces_leading_samples(hift: HiFTGenerator, ref: dict[str, torch.Tensor]) -> None:
    cache = torch.full((1, 1, 960), 0.25)
    _, source = hift.inference(ref["mel"], cache, generator=torch.Generator().manual_seed(1))
    _, plain = hift.inference(ref["mel"], generator=torch.Generator().manual_seed(1))
    assert torch.equal(source[:, :, :960], cache)
    assert torch.equal(source[:, :, 960:], plain[:, :, 960:])
    with pytest.raises(InputError):
        hift.inference(ref["mel"][:, :, :1], cache)
