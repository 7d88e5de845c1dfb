"""Writing audio files atomically: a failed or interrupted write leaves nothing half-written."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

from vocalis.errors import InputError

_SUBTYPES = {".wav": "PCM_16", ".flac": "PCM_16", ".ogg": "VORBIS"}


def check_output_path(path: str | Path) -> str:
    """Validate before any work is done; returns the soundfile subtype for the extension."""
    out = Path(path)
    subtype = _SUBTYPES.get(out.suffix.lower())
    if subtype is None:
        raise InputError(f"unsupported output extension {out.suffix!r}; use one of {', '.join(_SUBTYPES)}")
    if not out.parent.is_dir():
        raise InputError(f"output folder does not exist: {out.parent}")
    if out.is_dir():
        raise InputError(f"output path is a folder: {out}")
    return subtype


def write_audio(path: str | Path, samples: np.ndarray, sample_rate: int) -> Path:
    """(N,) float32 -> file; the format follows the extension (.wav, .flac, .ogg)."""
    out = Path(path)
    subtype = check_output_path(out)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_name, 0o666 & ~umask)  # mkstemp makes 0600; the result should look like any written file
    try:
        sf.write(tmp_name, np.clip(samples, -1.0, 1.0), sample_rate, subtype=subtype, format=out.suffix[1:].upper())
        os.replace(tmp_name, out)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return out
