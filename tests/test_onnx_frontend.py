"""ONNX frontend wrappers against tiny torch modules exported with the official models' signatures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from vocalis.errors import AudioError, ModelLoadError
from vocalis.frontend.audio import kaldi_fbank, whisper_log_mel
from vocalis.frontend.speaker import CampplusSpeakerEncoder, SpeakerEncoder
from vocalis.frontend.speech_tokenizer import OnnxSpeechTokenizer, SpeechTokenizer

pytest.importorskip("onnx")  # the legacy exporter writes through the onnx package
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # legacy exporter, on purpose


class TinySpeechTokenizer(nn.Module):
    """feats (1, 128, T) float32 + lengths (1,) int32 -> ids (1, ceil(T/4)): two stride-2 convs, argmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(128, 32, 3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(32, 64, 3, stride=2, padding=1)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = (torch.arange(feats.shape[2]).unsqueeze(0) < lengths.unsqueeze(1)).to(feats.dtype)  # (1, T)
        h = nn.functional.gelu(self.conv1(feats * mask.unsqueeze(1)))
        return self.conv2(h).argmax(dim=1)  # (1, T')


class TinySpeaker(nn.Module):
    """fbank (1, T, 80) -> (1, 192): mean + std pooling, then a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(160, 192)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        stats = torch.cat([feats.mean(dim=1), feats.std(dim=1)], dim=-1)  # (1, 160)
        return self.proj(stats)


def _voice(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    wav = sum(np.sin(2 * np.pi * 130 * k * t) / k for k in range(1, 6)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return (0.2 * wav + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.fixture(scope="module")
def onnx_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TinySpeechTokenizer, Path, TinySpeaker]:
    directory = tmp_path_factory.mktemp("onnx")
    torch.manual_seed(0)
    tokenizer, speaker = TinySpeechTokenizer().eval(), TinySpeaker().eval()
    tok_path, spk_path = directory / "speech_tokenizer_v2.onnx", directory / "campplus.onnx"
    torch.onnx.export(
        tokenizer, (torch.randn(1, 128, 100), torch.tensor([100], dtype=torch.int32)), str(tok_path),
        input_names=["feats", "feats_length"], output_names=["indices"],
        dynamic_axes={"feats": {2: "T"}, "indices": {1: "N"}}, dynamo=False,
    )
    torch.onnx.export(
        speaker, (torch.randn(1, 120, 80),), str(spk_path), input_names=["input"], output_names=["output"],
        dynamic_axes={"input": {1: "T"}}, dynamo=False,
    )
    return tok_path, tokenizer, spk_path, speaker


def test_speech_tokenizer_matches_torch(onnx_models) -> None:
    tok_path, module, _, _ = onnx_models
    wrapper = OnnxSpeechTokenizer(tok_path, intra_op_num_threads=2)
    assert isinstance(wrapper, SpeechTokenizer)
    for seconds in (0.5, 1.37, 3.0):
        wav = _voice(seconds, seed=int(seconds * 10))
        feats = whisper_log_mel(wav).unsqueeze(0)  # (1, 128, T)
        with torch.no_grad():
            expected = module(feats, torch.tensor([feats.shape[2]], dtype=torch.int32)).reshape(-1).tolist()
        ids = wrapper(wav)
        assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
        assert ids == expected
        assert len(ids) == -(-(-(-feats.shape[2] // 2)) // 2)  # two stride-2 convs: ~25 Hz
    assert wrapper.tokenize(torch.from_numpy(_voice(1.0))) == wrapper(_voice(1.0))


def test_speech_tokenizer_30s_limit(onnx_models) -> None:
    wrapper = OnnxSpeechTokenizer(onnx_models[0])
    with pytest.raises(AudioError, match="too long for the speech tokenizer"):
        wrapper(np.full(16000 * 31, 0.1, np.float32))


def test_speaker_encoder_matches_torch(onnx_models) -> None:
    _, _, spk_path, module = onnx_models
    encoder = CampplusSpeakerEncoder(spk_path)
    assert isinstance(encoder, SpeakerEncoder)
    wav = _voice(2.0, seed=3)
    feats = kaldi_fbank(wav, cmn=True).unsqueeze(0)  # (1, T, 80)
    with torch.no_grad():
        expected = module(feats).reshape(-1).numpy()
    embedding = encoder(wav)
    assert embedding.shape == (192,) and embedding.dtype == np.float32
    diff = np.abs(embedding - expected).max()
    print(f"campplus wrapper max abs diff vs torch: {diff:.2e}")
    assert diff < 1e-5
    np.testing.assert_array_equal(encoder.embed(torch.from_numpy(wav)), embedding)


def test_speaker_encoder_applies_cmn(onnx_models) -> None:
    # CMN makes the embedding invariant to a constant gain (a constant offset of every log-mel bin)
    encoder = CampplusSpeakerEncoder(onnx_models[2])
    wav = _voice(1.5, seed=4)
    np.testing.assert_allclose(encoder(wav), encoder(wav * 0.5), atol=1e-4)


def test_missing_or_bad_onnx(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        OnnxSpeechTokenizer(tmp_path / "none.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelLoadError, match="cannot load"):
        CampplusSpeakerEncoder(bad)
