"""Float audio chunks -> the bytes of a response format, incrementally, so audio can be sent as it is made.

Formats: wav, pcm (16-bit little-endian mono, OpenAI's `pcm`), flac, mp3, opus (Ogg Opus), aac (ADTS). flac/mp3/
opus use libsndfile through soundfile (its bundled libsndfile has FLAC, LAME/mpg123 and Opus); aac uses FFmpeg's
AAC encoder through PyAV, when installed (`pip install 'vocalis[aac]'`; its wheels bundle FFmpeg).
`supported_formats()` reports what the installed libraries can really write.

Streaming notes, because a sent byte cannot be taken back:
- wav: the header carries the "unknown length" sizes (0xFFFFFFFF), which readers treat as "until the end".
- flac: libsndfile fills STREAMINFO's sample count and MD5 at close; streamed, they stay 0 ("unknown"), which the
  FLAC format allows (ffmpeg and browsers play it; libsndfile's own reader will not seek in such a file).
- mp3: constant bitrate, so no VBR header has to be patched at the end.
- aac: ADTS, a header on every frame, so a stream is playable from any byte it was cut at.
Non-streamed responses (`encode_whole`) carry exact headers.
"""

from __future__ import annotations

import functools
import io
import struct
from typing import Any

import numpy as np
import soundfile as sf

from vocalis.errors import InputError

MEDIA_TYPES: dict[str, str] = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
    "aac": "audio/aac",
}
# format -> (libsndfile major format, subtype, extra SoundFile kwargs)
_LIBSNDFILE: dict[str, tuple[str, str, dict[str, object]]] = {
    "flac": ("FLAC", "PCM_16", {}),
    "mp3": ("MP3", "MPEG_LAYER_III", {"bitrate_mode": "CONSTANT", "compression_level": 0.5}),
    "opus": ("OGG", "OPUS", {}),
}
ALL_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")  # OpenAI's list


@functools.cache
def supported_formats() -> tuple[str, ...]:
    """Formats the installed libraries can write (wav and pcm always)."""
    found = ["wav", "pcm"]
    for fmt, (major, subtype, _) in _LIBSNDFILE.items():
        if major in sf.available_formats() and subtype in sf.available_subtypes(major):
            found.append(fmt)
    if _pyav() is not None:
        found.append("aac")
    return tuple(found)


@functools.cache
def _pyav() -> Any:
    """PyAV, when installed with FFmpeg's AAC encoder (the optional `aac` extra), else None."""
    try:
        import av
    except ImportError:
        return None
    try:
        av.codec.Codec("aac", "w")
    except Exception:  # noqa: BLE001  an FFmpeg build without it (PyAV raises its own error types)
        return None
    return av


class _AacEncoder:
    """Float chunks -> ADTS AAC bytes through PyAV (FFmpeg's native AAC encoder)."""

    def __init__(self, sample_rate: int) -> None:
        self._av = av = _pyav()
        self._out = io.BytesIO()
        self._container: Any = av.open(self._out, "w", format="adts")
        self._stream: Any = self._container.add_stream("aac", rate=sample_rate, layout="mono")
        self.sample_rate = sample_rate

    def _take(self) -> bytes:
        data = self._out.getvalue()
        self._out.seek(0)
        self._out.truncate()
        return data

    def push(self, samples: np.ndarray) -> bytes:
        if not len(samples):  # an empty chunk (a held-back silence, a stream's empty end): FFmpeg takes no empty frame
            return b""
        frame = self._av.AudioFrame.from_ndarray(np.clip(samples, -1.0, 1.0).astype(np.float32)[None, :],
                                                 format="flt", layout="mono")  # (1, N): one plane
        frame.sample_rate = self.sample_rate
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._take()

    def finish(self) -> bytes:
        for packet in self._stream.encode(None):  # the encoder's delayed frames
            self._container.mux(packet)
        self._container.close()
        return self._take()

    def close(self) -> None:
        """Free FFmpeg's encoder and container without finishing the file (a client that left); idempotent."""
        self._container.close()


def check_format(fmt: str) -> str:
    if fmt not in supported_formats():
        raise InputError(f"response_format {fmt!r} is not supported here; use one of: {', '.join(supported_formats())}")
    return fmt


def to_int16(samples: np.ndarray) -> bytes:
    """(N,) float32 in [-1, 1] -> little-endian 16-bit PCM bytes."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def wav_header(sample_rate: int, data_bytes: int | None = None) -> bytes:
    """44-byte PCM WAV header; `data_bytes=None` writes the streaming "unknown length" sizes."""
    data = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", riff) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", data)


class _GrowingBuffer:
    """A seekable file object for libsndfile that remembers how much has been handed out already."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.pos = 0
        self.sent = 0

    def write(self, b: bytes) -> int:
        end = self.pos + len(b)
        self.data[self.pos:end] = b
        self.pos = end
        return len(b)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, len(self.data))[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = len(self.data) if n < 0 else self.pos + n
        out = bytes(self.data[self.pos:end])
        self.pos += len(out)
        return out

    def take_new(self) -> bytes:
        """Bytes written past what was already handed out (rewrites of handed-out bytes are dropped)."""
        out = bytes(self.data[self.sent:])
        self.sent = len(self.data)
        return out


class AudioEncoder:
    """`push(samples) -> bytes` for each chunk, then `finish() -> bytes`. Concatenated, they are one file."""

    def __init__(self, fmt: str, sample_rate: int) -> None:
        self.fmt = check_format(fmt)
        self.sample_rate = sample_rate
        self.media_type = MEDIA_TYPES[fmt]
        self._started = False
        self._file: sf.SoundFile | None = None
        self._buf: _GrowingBuffer | None = None
        self._aac = _AacEncoder(sample_rate) if fmt == "aac" else None
        if fmt in _LIBSNDFILE:
            major, subtype, extra = _LIBSNDFILE[fmt]
            self._buf = _GrowingBuffer()
            self._file = sf.SoundFile(self._buf, "w", samplerate=sample_rate, channels=1, format=major,
                                      subtype=subtype, **extra)

    def push(self, samples: np.ndarray) -> bytes:
        if self._aac is not None:
            return self._aac.push(samples)
        if self._file is not None:
            assert self._buf is not None
            self._file.write(np.clip(samples, -1.0, 1.0).astype(np.float32))
            return self._buf.take_new()
        head = b""
        if self.fmt == "wav" and not self._started:
            head = wav_header(self.sample_rate)
        self._started = True
        return head + to_int16(samples)

    def finish(self) -> bytes:
        if self._aac is not None:
            aac, self._aac = self._aac, None
            return aac.finish()
        if self._file is not None:
            assert self._buf is not None
            self._file.close()
            self._file = None
            return self._buf.take_new()
        if self.fmt == "wav" and not self._started:
            self._started = True
            return wav_header(self.sample_rate)
        return b""

    def close(self) -> None:
        """Free the native encoder (FFmpeg's, libsndfile's) of a stream that ends without `finish` (the client
        left, the job failed): a response's or a session's `finally` calls it; after `finish` it does nothing."""
        if self._aac is not None:
            self._aac.close()
            self._aac = None
        if self._file is not None:
            try:
                self._file.close()
            except (RuntimeError, sf.SoundFileError):  # the format's end could not be written: nobody reads it
                pass
            self._file = None


def encode_whole(fmt: str, samples: np.ndarray, sample_rate: int) -> bytes:
    """A complete file with exact headers (for non-streamed responses)."""
    check_format(fmt)
    if fmt == "pcm":
        return to_int16(samples)
    if fmt == "wav":
        pcm = to_int16(samples)
        return wav_header(sample_rate, len(pcm)) + pcm
    if fmt == "aac":
        aac = _AacEncoder(sample_rate)
        return aac.push(samples) + aac.finish()
    major, subtype, extra = _LIBSNDFILE[fmt]
    out = io.BytesIO()
    with sf.SoundFile(out, "w", samplerate=sample_rate, channels=1, format=major, subtype=subtype, **extra) as f:
        f.write(np.clip(samples, -1.0, 1.0).astype(np.float32))
    return out.getvalue()
