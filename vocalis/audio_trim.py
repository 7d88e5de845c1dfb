"""Trailing silence trimmed off a request's audio, as it streams, and its end faded to zero.

A model often ends an utterance with a pause (the built-in model's last labels are a pause; a CosyVoice model may
trail off in near-silence), and a stream's last sample is rarely zero, which a player hears as a click where the
sound stops. `TailTrimmer` holds back the quiet run at the end of what it has seen (samples below `threshold`),
emits everything before it, and at the end keeps `keep_s` of that run, faded out over its last `fade_s` with a
raised cosine. The result depends only on the samples, never on how they were cut into chunks: a stream's tail
is the whole utterance's tail. Only quiet audio is held back, so the latency of speech is unchanged.

Legend: N samples.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from vocalis.frontend.request import AudioChunk


@dataclass(frozen=True)
class TrimConfig:
    """threshold: |sample| below it is silence (0.01: -40 dBFS); keep_s: silence kept after the last sound;
    fade_s: the fade-out at the very end (within the kept silence)."""

    threshold: float = 0.01
    keep_s: float = 0.1
    fade_s: float = 0.02

    def __post_init__(self) -> None:
        if not (self.threshold > 0 and self.keep_s >= 0 and self.fade_s >= 0):
            raise ValueError("threshold must be > 0, keep_s and fade_s >= 0")


class TailTrimmer:
    """One request's audio in order: `push` each piece (what may be sent now comes back), then `finish` once."""

    def __init__(self, sample_rate: int, config: TrimConfig | None = None) -> None:
        self.config = config or TrimConfig()
        self.sample_rate = sample_rate
        self._held = np.zeros(0, np.float32)  # the quiet run at the end of what was pushed

    def push(self, samples: np.ndarray) -> np.ndarray:
        """(N,) float32 -> the samples that may be sent now (up to the last one above the threshold)."""
        x = np.concatenate([self._held, np.asarray(samples, np.float32)]) if len(self._held) else samples
        loud = np.flatnonzero(np.abs(x) >= self.config.threshold)
        cut = int(loud[-1]) + 1 if len(loud) else 0
        self._held = np.asarray(x[cut:], np.float32)
        return np.asarray(x[:cut], np.float32)

    def finish(self) -> np.ndarray:
        """The end: `keep_s` of the held silence, faded to zero over its last `fade_s`."""
        tail = self._held[: round(self.config.keep_s * self.sample_rate)].copy()
        self._held = np.zeros(0, np.float32)
        n = min(len(tail), round(self.config.fade_s * self.sample_rate))
        if n:
            tail[-n:] *= 0.5 * (1.0 + np.cos(np.pi * np.arange(1, n + 1) / n))  # 1 -> 0, the last sample 0
        return tail


def _trimmed(chunk: AudioChunk, trimmer: TailTrimmer) -> AudioChunk:
    samples = trimmer.push(chunk.samples)
    if chunk.final:
        samples = np.concatenate([samples, trimmer.finish()])
    return replace(chunk, samples=samples)


def trim_chunks(chunks: Iterable[AudioChunk], config: TrimConfig | None = None) -> Iterator[AudioChunk]:
    """A request's chunks with its trailing silence trimmed (a chunk may come out shorter, or empty)."""
    trimmer: TailTrimmer | None = None
    for chunk in chunks:
        trimmer = trimmer or TailTrimmer(chunk.sample_rate, config)
        yield _trimmed(chunk, trimmer)


async def atrim_chunks(chunks: AsyncIterable[AudioChunk], config: TrimConfig | None = None
                       ) -> AsyncIterator[AudioChunk]:
    """`trim_chunks` for async iterables."""
    trimmer: TailTrimmer | None = None
    async for chunk in chunks:
        trimmer = trimmer or TailTrimmer(chunk.sample_rate, config)
        yield _trimmed(chunk, trimmer)
