"""A fast YIN pitch tracker in numpy: 24 kHz audio -> F0 (Hz) per 50 Hz mel frame, 0 where unvoiced.

The vocoder's F0 loss needs a target pitch aligned with the mel frames (the official recipe uses pyworld
harvest + stonemask). YIN (de Cheveigné & Kawahara, 2002) on an 8 kHz copy is accurate to a few cents on
voiced speech and runs several hundred times faster than real time, vectorised over frames with FFTs.

Legend: N samples, T frames, W window, L lags.
"""

from __future__ import annotations

import math

import numpy as np
import soxr

from vocalis.config import SAMPLE_RATE, SAMPLES_PER_MEL_FRAME

ANALYSIS_RATE = 8000  # enough bandwidth for a 50-600 Hz fundamental
F0_MIN = 50.0
F0_MAX = 600.0
YIN_THRESHOLD = 0.15  # cumulative-mean-normalised difference below which a dip counts as periodic
SILENCE_RMS = 1e-3  # frames quieter than this are unvoiced whatever their periodicity


def _frames(x: np.ndarray, num_frames: int, hop: int, length: int, first_start: int) -> np.ndarray:
    """(T, length) frames starting at first_start + t * hop, zero outside the signal."""
    pad_left = max(0, -first_start)
    pad_right = max(0, first_start + (num_frames - 1) * hop + length - len(x))
    padded = np.pad(x, (pad_left, pad_right))
    start = first_start + pad_left
    idx = start + hop * np.arange(num_frames)[:, None] + np.arange(length)[None, :]  # (T, length)
    return padded[idx]


def yin_f0(
    wav: np.ndarray,
    sample_rate: int = SAMPLE_RATE,
    hop_samples: int = SAMPLES_PER_MEL_FRAME,
    num_frames: int | None = None,
    f0_min: float = F0_MIN,
    f0_max: float = F0_MAX,
    threshold: float = YIN_THRESHOLD,
) -> np.ndarray:
    """F0 in Hz, (T,) float32, for audio (N,) at `sample_rate`; frame t is centred on sample t*hop + hop/2,
    which is where the Matcha mel puts its frame t. T defaults to N // hop (the mel's frame count)."""
    num_frames = len(wav) // hop_samples if num_frames is None else num_frames
    if num_frames <= 0:
        return np.zeros(0, dtype=np.float32)
    x = np.asarray(wav, dtype=np.float32)
    if sample_rate != ANALYSIS_RATE:
        x = soxr.resample(x, sample_rate, ANALYSIS_RATE).astype(np.float32, copy=False)
    hop = hop_samples * ANALYSIS_RATE / sample_rate  # 160 at 8 kHz
    max_lag = math.ceil(ANALYSIS_RATE / f0_min)  # 160
    min_lag = int(np.floor(ANALYSIS_RATE / f0_max))  # 13
    window = max_lag * 2  # two periods of the lowest pitch

    # Frames of window + max_lag samples centred on each mel frame's centre.
    centre = (np.arange(num_frames) + 0.5) * hop
    if float(hop).is_integer():
        frames = _frames(x, num_frames, int(hop), window + max_lag, int(np.rint(centre[0])) - (window + max_lag) // 2)
    else:  # non-integer hop (other rates): gather per frame
        starts = np.round(centre).astype(np.int64) - (window + max_lag) // 2
        padded = np.pad(x, (window + max_lag, window + max_lag))
        frames = padded[starts[:, None] + window + max_lag + np.arange(window + max_lag)[None, :]]
    frames = frames.astype(np.float64)  # (T, W + L)

    # Difference function d(tau) = sum_{j<W} (x_j - x_{j+tau})^2 = e0 + e_tau - 2 r(tau), r by FFT.
    n_fft = 1 << int(np.ceil(np.log2(2 * (window + max_lag))))
    spec_full = np.fft.rfft(frames, n_fft)
    spec_head = np.fft.rfft(frames[:, :window], n_fft)
    r = np.fft.irfft(spec_full * np.conj(spec_head), n_fft)[:, : max_lag + 1]  # (T, L + 1)
    sq = np.concatenate([np.zeros((num_frames, 1)), np.cumsum(frames**2, axis=1)], axis=1)
    lags = np.arange(max_lag + 1)
    e_tau = sq[:, lags + window] - sq[:, lags]  # energy of x[tau : tau + W]
    d = np.maximum(sq[:, [window]] + e_tau - 2 * r, 0.0)  # (T, L + 1)

    # Cumulative-mean normalisation: d'(tau) = d(tau) * tau / sum_{k<=tau} d(k), d'(0) = 1.
    cum = np.cumsum(d[:, 1:], axis=1)
    cmnd = np.ones_like(d)
    cmnd[:, 1:] = d[:, 1:] * lags[1:] / np.maximum(cum, 1e-12)

    # First dip under the threshold in [min_lag, max_lag), then walk down to its local minimum.
    search = cmnd[:, min_lag:max_lag]
    below = search < threshold
    voiced = below.any(axis=1)
    first = np.argmax(below, axis=1)
    tau = first.copy()
    limit = search.shape[1] - 1
    for _ in range(search.shape[1]):  # vectorised descent; stops early once every frame is at a minimum
        step = (tau < limit) & (search[np.arange(num_frames), np.minimum(tau + 1, limit)] < search[np.arange(num_frames), tau])
        if not step.any():
            break
        tau = tau + step
    tau = tau + min_lag

    # Parabolic interpolation around the chosen lag.
    rows = np.arange(num_frames)
    left = cmnd[rows, np.maximum(tau - 1, 1)]
    mid = cmnd[rows, tau]
    right = cmnd[rows, np.minimum(tau + 1, max_lag)]
    denom = left - 2 * mid + right
    shift = np.where(np.abs(denom) > 1e-12, 0.5 * (left - right) / np.where(denom == 0, 1, denom), 0.0)
    period = tau + np.clip(shift, -1, 1)

    rms = np.sqrt(sq[:, window] / window)
    voiced &= rms > SILENCE_RMS
    f0 = np.where(voiced, ANALYSIS_RATE / period, 0.0)
    return f0.astype(np.float32)
