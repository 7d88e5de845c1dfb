"""Audio loading and the three prompt features of CosyVoice 2.

- `load_wav`: any soundfile-readable file/handle -> mono float32 at the requested rate (soxr), validated.
- `whisper_log_mel`: 16 kHz -> (128, T) Whisper log-mel at 100 Hz, input of the speech tokenizer.
- `kaldi_fbank`: 16 kHz -> (T, 80) Kaldi fbank, input of the CAM++ speaker encoder.
- `prompt_mel` / `mel_spectrogram`: 24 kHz -> (T, 80) Matcha log-mel at 50 Hz, the flow's prompt/target mel.
- `align_prompt`: the 2 mel frames : 1 token trim the flow requires.

Legend: N samples, T frames, B batch.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np
import soundfile as sf
import soxr
import torch

from vocalis.config import MAX_PROMPT_SECONDS, TOKEN_MEL_RATIO
from vocalis.errors import AudioError

logger = logging.getLogger(__name__)

AudioSource = str | os.PathLike | BinaryIO
DEFAULT_MIN_SECONDS = 0.5
SILENCE_PEAK = 1e-4

# Whisper front end (speech tokenizer).
WHISPER_SAMPLE_RATE = 16000
WHISPER_N_FFT = 400
WHISPER_HOP = 160
# Matcha mel (flow prompt), CosyVoice 2 values.
PROMPT_SAMPLE_RATE = 24000
PROMPT_N_FFT = 1920
PROMPT_HOP = 480
PROMPT_N_MELS = 80
PROMPT_FMIN = 0.0
PROMPT_FMAX = 8000.0


# ---------------------------------------------------------------------------------------------------
# Loading and validation


def check_wav(
    wav: np.ndarray,
    sample_rate: int,
    *,
    min_seconds: float = DEFAULT_MIN_SECONDS,
    max_seconds: float | None = MAX_PROMPT_SECONDS,
    silence_peak: float = SILENCE_PEAK,
    name: str = "audio",
) -> None:
    """Raise AudioError unless `wav` (N,) is finite, audible and within the duration limits."""
    if wav.ndim != 1:
        raise AudioError(f"{name}: expected mono audio of shape (N,), got {tuple(wav.shape)}")
    if wav.size == 0:
        raise AudioError(f"{name} is empty (0 samples)")
    if not np.isfinite(wav).all():
        raise AudioError(f"{name} contains NaN or infinite samples: the file is corrupt")
    seconds = wav.size / sample_rate
    if seconds < min_seconds:
        raise AudioError(f"{name} is too short: {seconds:.2f} s, need at least {min_seconds:g} s")
    if max_seconds is not None and seconds > max_seconds:
        raise AudioError(f"{name} is too long: {seconds:.1f} s, the limit is {max_seconds:g} s; trim it")
    peak = float(np.abs(wav).max())
    if peak < silence_peak:
        raise AudioError(f"{name} is silent (peak amplitude {peak:.2e}); record or choose audible speech")


def _read(source: AudioSource, name: str, max_seconds: float | None) -> tuple[np.ndarray, int]:
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.exists():
            raise AudioError(f"audio file not found: {path}")
        if not path.is_file():
            raise AudioError(f"not an audio file: {path} is a directory or special file")
    try:
        with sf.SoundFile(source) as f:
            sample_rate = f.samplerate
            # Reject over-long files from the header, before decoding them.
            if max_seconds is not None and f.frames > 0 and f.frames / sample_rate > max_seconds:
                raise AudioError(
                    f"{name} is too long: {f.frames / sample_rate:.1f} s, the limit is {max_seconds:g} s; trim it"
                )
            audio = f.read(dtype="float32", always_2d=True)  # (N, C)
    except sf.SoundFileError as exc:
        raise AudioError(f"cannot read {name} as audio ({exc}); use WAV/FLAC/OGG/MP3") from exc
    return audio, sample_rate


def load_wav(
    source: AudioSource,
    target_sr: int,
    *,
    min_seconds: float = DEFAULT_MIN_SECONDS,
    max_seconds: float | None = MAX_PROMPT_SECONDS,
    silence_peak: float = SILENCE_PEAK,
) -> np.ndarray:
    """Read `source`, average the channels and resample to `target_sr`: (N,) float32 in [-1, 1].

    Any input rate is accepted (soxr high quality). Defaults fit prompts: 0.5 s to 30 s; pass
    `max_seconds=None` for source audio without an upper limit. Raises AudioError for a missing,
    unreadable, empty, non-finite, silent, too short or too long file.
    """
    name = str(source) if isinstance(source, (str, os.PathLike)) else "audio stream"
    audio, sample_rate = _read(source, name, max_seconds)
    wav = audio.mean(axis=1, dtype=np.float32)  # (N,)
    check_wav(wav, sample_rate, min_seconds=min_seconds, max_seconds=max_seconds, silence_peak=silence_peak, name=name)
    if sample_rate != target_sr:
        wav = soxr.resample(wav, sample_rate, target_sr).astype(np.float32, copy=False)
    return wav


# ---------------------------------------------------------------------------------------------------
# Features


def _as_tensor(wav: np.ndarray | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(np.asarray(wav) if isinstance(wav, np.ndarray) else wav, dtype=torch.float32)


def _need_samples(wav: torch.Tensor, n: int, what: str) -> None:
    if wav.shape[-1] < n:
        raise AudioError(f"audio too short for {what}: {wav.shape[-1]} samples, need at least {n}")


@functools.cache
def mel_filters(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """librosa (Slaney) mel filter bank, (n_mels, n_fft // 2 + 1) float32, cached per process, read-only.

    For (16000, 400, 128) these are Whisper's `mel_filters.npz` filters.
    """
    import librosa  # imported lazily: librosa's import pulls numba, unneeded unless features are computed

    basis = librosa.filters.mel(sr=sample_rate, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax).astype(np.float32)
    basis.setflags(write=False)
    return basis


def _filters(device: torch.device, *args: float | int | None) -> torch.Tensor:
    return torch.from_numpy(mel_filters(*args).copy()).to(device)


def whisper_log_mel(wav16k: np.ndarray | torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """Whisper log-mel of 16 kHz audio (N,) -> (n_mels, N // 160), the speech tokenizer input.

    STFT n_fft 400 / hop 160 with a periodic Hann window, centred (reflect padding), last frame dropped,
    power spectrum, mel, log10 clamped at 1e-10, floor at max - 8, then (x + 4) / 4.
    """
    wav = _as_tensor(wav16k)
    _need_samples(wav, WHISPER_N_FFT // 2 + 1, "the Whisper log-mel")
    window = torch.hann_window(WHISPER_N_FFT, device=wav.device)
    stft = torch.stft(
        wav, WHISPER_N_FFT, WHISPER_HOP, window=window, center=True, pad_mode="reflect", return_complex=True
    )  # (201, T + 1)
    power = stft[..., :-1].abs() ** 2  # (201, T)
    mel = _filters(wav.device, WHISPER_SAMPLE_RATE, WHISPER_N_FFT, n_mels) @ power  # (n_mels, T)
    log_mel = torch.clamp(mel, min=1e-10).log10()
    log_mel = torch.maximum(log_mel, log_mel.max() - 8.0)
    return (log_mel + 4.0) / 4.0


def kaldi_fbank(wav16k: np.ndarray | torch.Tensor, *, num_mel_bins: int = 80, cmn: bool = False) -> torch.Tensor:
    """Kaldi fbank of 16 kHz audio (N,) -> (T, num_mel_bins), T = 1 + (N - 400) // 160.

    Kaldi defaults (25 ms / 10 ms frames, povey window, pre-emphasis 0.97, DC removal, snip_edges) with
    dither 0, on the float waveform (not int16-scaled), as the official CAM++ front end. `cmn=True`
    subtracts the mean over time.
    """
    import kaldi_native_fbank as knf

    wav = _as_tensor(wav16k).cpu().numpy()
    if wav.shape[-1] < 400:
        raise AudioError(f"audio too short for the Kaldi fbank: {wav.shape[-1]} samples, need at least 400")
    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq = 16000
    opts.frame_opts.dither = 0.0
    opts.mel_opts.num_bins = num_mel_bins
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(16000, wav)
    fbank.input_finished()
    feats = torch.from_numpy(np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)]))  # (T, D)
    if cmn:
        feats = feats - feats.mean(dim=0, keepdim=True)
    return feats


def mel_spectrogram(
    wav: np.ndarray | torch.Tensor,
    sample_rate: int = PROMPT_SAMPLE_RATE,
    n_fft: int = PROMPT_N_FFT,
    hop_size: int = PROMPT_HOP,
    n_mels: int = PROMPT_N_MELS,
    fmin: float = PROMPT_FMIN,
    fmax: float | None = PROMPT_FMAX,
    win_size: int | None = None,
) -> torch.Tensor:
    """Matcha-TTS log-mel: (N,) -> (n_mels, T) or (B, N) -> (B, n_mels, T), T = N // hop_size.

    Reflect-pad (n_fft - hop) / 2 on both sides, un-centred STFT with a periodic Hann window,
    magnitude sqrt(re^2 + im^2 + 1e-9), Slaney mel (librosa defaults), natural log clamped at 1e-5.
    Defaults are the CosyVoice 2 flow settings; training losses use other `fmax` values.
    """
    wav = _as_tensor(wav)
    win_size = win_size or n_fft
    pad = (n_fft - hop_size) // 2
    _need_samples(wav, pad + 1, "the mel spectrogram")
    batched = wav.dim() == 2
    x = wav if batched else wav.unsqueeze(0)  # (B, N)
    x = torch.nn.functional.pad(x.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)  # (B, N + 2 pad)
    window = torch.hann_window(win_size, device=x.device)
    spec = torch.stft(
        x, n_fft, hop_size, win_size, window=window, center=False, normalized=False, onesided=True, return_complex=True
    )  # (B, n_fft // 2 + 1, T)
    magnitude = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + 1e-9)
    mel = _filters(x.device, sample_rate, n_fft, n_mels, fmin, fmax) @ magnitude  # (B, n_mels, T)
    log_mel = torch.log(torch.clamp(mel, min=1e-5))
    return log_mel if batched else log_mel[0]


def prompt_mel(wav24k: np.ndarray | torch.Tensor, fmax: float | None = PROMPT_FMAX) -> torch.Tensor:
    """Flow prompt mel of 24 kHz audio (N,) -> (T, 80) time-major, T = N // 480 (50 Hz). `fmax` is the flow's: 8 kHz
    for CosyVoice 2, None (Nyquist) for CosyVoice 3."""
    return mel_spectrogram(wav24k, fmax=fmax).transpose(0, 1)


# ---------------------------------------------------------------------------------------------------
# Prompt alignment

TokenSeq = TypeVar("TokenSeq", list[int], tuple[int, ...], torch.Tensor, np.ndarray)


def align_prompt(mel: torch.Tensor, tokens: TokenSeq) -> tuple[torch.Tensor, TokenSeq]:
    """Trim prompt mel (T, 80) and prompt tokens so that mel frames = 2 x tokens (the flow's requirement).

    n = min(T // 2, len(tokens)); returns (mel[: 2n], tokens[: n]), tokens of the type given.
    """
    num_tokens = min(mel.shape[0] // TOKEN_MEL_RATIO, len(tokens))
    if num_tokens == 0:
        raise AudioError(
            f"prompt too short to align: {mel.shape[0]} mel frames and {len(tokens)} speech tokens"
        )
    if num_tokens < len(tokens) or TOKEN_MEL_RATIO * num_tokens < mel.shape[0]:
        logger.debug("prompt trimmed to %d tokens / %d frames", num_tokens, TOKEN_MEL_RATIO * num_tokens)
    return mel[: TOKEN_MEL_RATIO * num_tokens], tokens[:num_tokens]
