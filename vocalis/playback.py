"""Playing speech on the machine's sound output (`vocalis speak --play`), through miniaudio (`pip install
'vocalis[play]'`): its wheels carry the audio code and reach PulseAudio, ALSA, JACK, CoreAudio or WASAPI at run time,
so nothing beyond the registry's package is needed. Chunks play as they are given (a stream starts sounding at its
first chunk); where there is no library or no output device, `PlaybackUnavailable` says so."""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Generator, Iterator

import numpy as np

from vocalis.errors import VocalisError

_DRAIN_S = 0.3  # after the last sample is handed over: the device's buffer (200 ms) plays out


class PlaybackUnavailable(VocalisError):
    """No sound library or no output device here."""


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    # ALSA's library prints a dozen lines to fd 2 while it looks for a card that is not there
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class Player:
    """Float32 mono chunks at `sample_rate` -> the default output device, in order, as they come."""

    def __init__(self, sample_rate: int) -> None:
        try:
            import miniaudio
        except ImportError as e:
            raise PlaybackUnavailable("no sound library (pip install 'vocalis[play]' installs miniaudio)") from e
        # every real backend, not the "null" device miniaudio falls back to (which plays into nothing)
        backends = [b for b in miniaudio.Backend if b not in (miniaudio.Backend.NULL, miniaudio.Backend.CUSTOM)]
        with _quiet_native_stderr():
            try:
                self._device = miniaudio.PlaybackDevice(output_format=miniaudio.SampleFormat.FLOAT32, nchannels=1,
                                                        sample_rate=sample_rate, backends=backends)
            except miniaudio.MiniaudioError as e:
                raise PlaybackUnavailable(f"no audio output device ({e.args[0] if e.args else e})") from e
        self.device_name = getattr(self._device, "name", "")
        self._chunks: queue.SimpleQueue[np.ndarray | None] = queue.SimpleQueue()
        self._played = threading.Event()
        frames = self._frames()
        next(frames)
        self._device.start(frames)

    def play(self, samples: np.ndarray) -> None:
        """Queue (N,) samples after those given before."""
        self._chunks.put(np.ascontiguousarray(samples, dtype=np.float32))

    def finish(self, timeout: float | None = None) -> None:
        """Wait until everything queued has played, then close the device."""
        self._chunks.put(None)
        if self._played.wait(timeout):
            time.sleep(_DRAIN_S)  # the device's own buffer still plays after the last samples were handed over
        self._device.close()

    def _frames(self) -> Generator[bytes, int, None]:
        # miniaudio's callback protocol: it sends how many frames it needs, the generator yields that many samples
        pending = np.zeros(0, dtype=np.float32)
        ended = False
        needed = yield b""
        while True:
            while len(pending) < needed and not ended:
                try:
                    chunk = self._chunks.get_nowait()
                except queue.Empty:
                    break
                if chunk is None:
                    ended = True
                else:
                    pending = np.concatenate([pending, chunk])
            out, pending = pending[:needed], pending[needed:]
            if ended and not len(pending):
                self._played.set()
            if len(out) < needed:  # an underrun (the stream is behind) or the end: silence
                out = np.concatenate([out, np.zeros(needed - len(out), dtype=np.float32)])
            needed = yield out.tobytes()
