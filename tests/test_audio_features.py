"""Audio loading/validation and the three prompt features, checked against direct numpy/librosa maths."""

from __future__ import annotations

import io
from pathlib import Path

import librosa
import numpy as np
import pytest
import soundfile as sf
import torch

from vocalis.errors import AudioError
from vocalis.frontend.audio import (
    align_prompt,
    check_wav,
    kaldi_fbank,
    load_wav,
    mel_filters,
    mel_spectrogram,
    prompt_mel,
    whisper_log_mel,
)


def _voice(seconds: float, sr: int, seed: int = 0) -> np.ndarray:
    """Harmonic tone with vibrato, amplitude modulation and a little noise (float32)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * sr))) / sr
    phase = 2 * np.pi * np.cumsum(150 + 20 * np.sin(2 * np.pi * 0.5 * t)) / sr
    wav = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.4 + 0.6 * np.sin(2 * np.pi * 2 * t) ** 2)
    return (0.3 * wav / np.abs(wav).max() + 0.003 * rng.standard_normal(t.size)).astype(np.float32)


# ---------------------------------------------------------------------------------------------------
# Loading


def test_load_resamples_any_rate(tmp_path: Path) -> None:
    for sr in (8000, 22050, 44100, 48000, 16000):
        path = tmp_path / f"a{sr}.wav"
        sf.write(path, _voice(1.0, sr), sr)
        wav = load_wav(path, 16000)
        assert wav.dtype == np.float32 and wav.ndim == 1
        assert abs(wav.size - 16000) <= 1


def test_load_mixes_stereo_44k(tmp_path: Path) -> None:
    sr = 44100
    t = np.arange(int(1.5 * sr)) / sr
    left = 0.5 * np.sin(2 * np.pi * 440 * t)
    stereo = np.stack([left, 0.5 * left], axis=1).astype(np.float32)  # (N, 2)
    path = tmp_path / "stereo.wav"
    sf.write(path, stereo, sr, subtype="FLOAT")
    wav = load_wav(path, 16000)
    assert abs(wav.size - 24000) <= 1
    spectrum = np.abs(np.fft.rfft(wav))
    assert abs(np.argmax(spectrum) * 16000 / wav.size - 440) < 1.0  # pitch preserved
    middle = wav[2000:-2000]
    assert np.sqrt(2) * middle.std() == pytest.approx(0.375, rel=1e-2)  # mean of the channels: 0.75 x 0.5
    # file handle input gives the same result
    with open(path, "rb") as f:
        np.testing.assert_array_equal(load_wav(io.BytesIO(f.read()), 16000), wav)


def _wav_bytes(data: np.ndarray, sr: int, subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, data, sr, format="WAV", subtype=subtype)
    return buf.getvalue()


def test_audio_errors(tmp_path: Path) -> None:
    with pytest.raises(AudioError, match="not found"):
        load_wav(tmp_path / "missing.wav", 16000)
    with pytest.raises(AudioError, match="directory"):
        load_wav(tmp_path, 16000)

    text = tmp_path / "notes.wav"
    text.write_text("this is a text file, not audio\n" * 20)
    with pytest.raises(AudioError, match="cannot read"):
        load_wav(text, 16000)

    empty_file = tmp_path / "zero_bytes.wav"
    empty_file.write_bytes(b"")
    with pytest.raises(AudioError, match="cannot read"):
        load_wav(empty_file, 16000)

    truncated = tmp_path / "truncated.wav"
    truncated.write_bytes(_wav_bytes(_voice(1.0, 16000), 16000)[:30])  # header cut before the data chunk
    with pytest.raises(AudioError, match="cannot read"):
        load_wav(truncated, 16000)

    no_frames = tmp_path / "no_frames.wav"
    sf.write(no_frames, np.zeros(0, np.float32), 16000)
    with pytest.raises(AudioError, match="empty"):
        load_wav(no_frames, 16000)

    short = tmp_path / "short.wav"
    sf.write(short, _voice(0.1, 16000), 16000)
    with pytest.raises(AudioError, match="too short: 0.10 s"):
        load_wav(short, 16000)

    silent = tmp_path / "silent.wav"
    sf.write(silent, np.zeros(16000, np.float32), 16000)
    with pytest.raises(AudioError, match="silent"):
        load_wav(silent, 16000)

    long = tmp_path / "long.wav"
    sf.write(long, _voice(40.0, 8000), 8000)
    with pytest.raises(AudioError, match="too long: 40.0 s"):
        load_wav(long, 16000)
    assert load_wav(long, 8000, max_seconds=None).size == 320000  # no limit for source audio

    nan = tmp_path / "nan.wav"
    data = _voice(1.0, 16000)
    data[100] = np.nan
    sf.write(nan, data, 16000, subtype="FLOAT")
    with pytest.raises(AudioError, match="NaN"):
        load_wav(nan, 16000)
    data[100] = np.inf
    with pytest.raises(AudioError, match="NaN or infinite"):
        check_wav(data, 16000)


def test_truncated_data_chunk_loads_what_is_there(tmp_path: Path) -> None:
    # libsndfile reads the frames present when only the data chunk is cut; that is usable audio
    path = tmp_path / "cut.wav"
    path.write_bytes(_wav_bytes(_voice(2.0, 16000), 16000)[:44 + 2 * 16000])
    assert load_wav(path, 16000).size == 16000


# ---------------------------------------------------------------------------------------------------
# Whisper log-mel (speech tokenizer input)


def _whisper_reference(wav: np.ndarray) -> np.ndarray:
    """Direct numpy/librosa computation in float64."""
    spec = librosa.stft(wav.astype(np.float64), n_fft=400, hop_length=160, window="hann", center=True,
                        pad_mode="reflect")
    power = np.abs(spec[:, :-1]) ** 2
    filters = librosa.filters.mel(sr=16000, n_fft=400, n_mels=128, dtype=np.float64)
    log_spec = np.log10(np.maximum(filters @ power, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def test_whisper_log_mel_matches_direct_computation() -> None:
    wav = _voice(2.345, 16000)
    mel = whisper_log_mel(wav)
    assert mel.shape == (128, wav.size // 160) and mel.dtype == torch.float32
    diff = (mel.double().numpy() - _whisper_reference(wav)).__abs__().max()
    print(f"whisper_log_mel max abs diff vs float64 numpy/librosa: {diff:.2e}")
    assert diff < 1e-4
    torch.testing.assert_close(whisper_log_mel(torch.from_numpy(wav)), mel)


def test_whisper_filters_are_librosa_slaney() -> None:
    filters = mel_filters(16000, 400, 128)
    assert filters.shape == (128, 201) and filters.dtype == np.float32
    assert mel_filters(16000, 400, 128) is filters  # cached per process
    assert not filters.flags.writeable


# ---------------------------------------------------------------------------------------------------
# Kaldi fbank (speaker encoder input)


def test_kaldi_fbank_shape_and_cmn() -> None:
    wav = _voice(1.0, 16000)
    feats = kaldi_fbank(wav)
    assert feats.shape == (98, 80) and feats.dtype == torch.float32
    normed = kaldi_fbank(wav, cmn=True)
    torch.testing.assert_close(normed, feats - feats.mean(0, keepdim=True))
    assert normed.mean(0).abs().max() < 1e-4
    # dither 0: deterministic
    torch.testing.assert_close(kaldi_fbank(wav), feats, rtol=0, atol=0)


def test_kaldi_fbank_uses_float_scale() -> None:
    # a float waveform (not int16-scaled): log energies are log(power) of the [-1, 1] signal.
    wav = _voice(1.0, 16000)
    louder = kaldi_fbank(wav * 2)
    diff = (louder - kaldi_fbank(wav)).mean().item()
    assert diff == pytest.approx(np.log(4.0), abs=1e-2)
    assert kaldi_fbank(wav).max() < 10  # int16 scaling would add ~log(32768^2) = 20.8


# ---------------------------------------------------------------------------------------------------
# Matcha mel (flow prompt)


def _matcha_reference(wav: np.ndarray) -> np.ndarray:
    """Direct numpy computation in float64: reflect pad 720, framed rFFT, magnitude, Slaney mel, log."""
    x = np.pad(wav.astype(np.float64), (720, 720), mode="reflect")
    num_frames = 1 + (x.size - 1920) // 480
    frames = np.stack([x[i * 480 : i * 480 + 1920] for i in range(num_frames)])  # (T, 1920)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(1920) / 1920)  # periodic Hann
    spec = np.fft.rfft(frames * window, axis=1)  # (T, 961)
    magnitude = np.sqrt(spec.real**2 + spec.imag**2 + 1e-9)
    filters = librosa.filters.mel(sr=24000, n_fft=1920, n_mels=80, fmin=0, fmax=8000, dtype=np.float64)
    return np.log(np.maximum(magnitude @ filters.T, 1e-5))  # (T, 80)


@pytest.mark.parametrize("num_samples", [12000, 24000, 24479, 24480, 24481, 50000])
def test_prompt_mel_frames(num_samples: int) -> None:
    wav = _voice(num_samples / 24000, 24000)[:num_samples]
    assert prompt_mel(wav).shape == (num_samples // 480, 80)


def test_prompt_mel_matches_direct_computation() -> None:
    wav = _voice(1.7, 24000)
    mel = prompt_mel(wav)
    diff = np.abs(mel.double().numpy() - _matcha_reference(wav)).max()
    print(f"prompt_mel max abs diff vs float64 numpy: {diff:.2e}")
    assert diff < 1e-4


def test_mel_spectrogram_batched_and_general() -> None:
    wavs = torch.from_numpy(np.stack([_voice(1.0, 24000, seed=1), _voice(1.0, 24000, seed=2)]))
    batched = mel_spectrogram(wavs)
    assert batched.shape == (2, 80, 50)
    torch.testing.assert_close(batched[1], mel_spectrogram(wavs[1]))
    # general form, e.g. the GAN loss mel (fmax = Nyquist) at 22.05 kHz / hop 256
    other = mel_spectrogram(
        _voice(1.0, 22050), sample_rate=22050, n_fft=1024, hop_size=256, n_mels=80, fmin=0, fmax=None
    )
    assert other.shape == (80, 22050 // 256)


def test_features_reject_too_short_audio() -> None:
    for fn, n in ((whisper_log_mel, 100), (kaldi_fbank, 300), (prompt_mel, 500)):
        with pytest.raises(AudioError, match="too short"):
            fn(np.full(n, 0.1, np.float32))


# ---------------------------------------------------------------------------------------------------
# Prompt alignment


def test_align_prompt_2_to_1() -> None:
    mel = torch.randn(101, 80)
    m, t = align_prompt(mel, list(range(60)))  # mel-limited: 50 tokens
    assert m.shape == (100, 80) and t == list(range(50))
    m, t = align_prompt(mel, torch.arange(30))  # token-limited: 60 frames
    assert m.shape == (60, 80) and torch.equal(t, torch.arange(30))
    torch.testing.assert_close(m, mel[:60])
    m, t = align_prompt(mel[:10], (1, 2, 3, 4, 5))
    assert m.shape[0] == 10 and t == (1, 2, 3, 4, 5)
    with pytest.raises(AudioError, match="too short"):
        align_prompt(mel[:1], [1, 2])
