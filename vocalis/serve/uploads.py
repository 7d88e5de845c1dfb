"""Reading request bodies the speech and voice routes accept: JSON or multipart, with audio uploads checked.

Uploads stay in memory (bounded by the size limit) and the form's spooled temporary files are closed before
the handler returns, so a rejected request leaves nothing behind.
"""

from __future__ import annotations

import io
from typing import Any

import soundfile as sf
from fastapi import Request, UploadFile
from starlette.datastructures import UploadFile as StarletteUpload

from vocalis.errors import InputError
from vocalis.serve.config import ServeConfig
from vocalis.serve.schemas import PayloadTooLarge, decode_base64_audio

ACCEPTED_AUDIO = "WAV, FLAC, OGG (Vorbis/Opus) or MP3"


class UnsupportedMedia(InputError):
    """HTTP 415."""


def check_audio_bytes(data: bytes, config: ServeConfig, what: str) -> bytes:
    """Size and type checks before any work is queued: 413 too big, 400 empty, 415 not a known audio type."""
    if len(data) > config.max_upload_bytes:
        raise PayloadTooLarge(f"{what} is larger than the {config.max_upload_bytes // (1024 * 1024)} MiB limit")
    if not data:
        raise InputError(f"{what} is empty")
    try:
        info = sf.info(io.BytesIO(data))
    except (sf.SoundFileError, RuntimeError, ValueError):
        raise UnsupportedMedia(f"{what} is not audio this server can read; send {ACCEPTED_AUDIO}") from None
    if info.frames == 0:
        raise InputError(f"{what} holds no audio samples")
    return data


def audio_seconds(data: bytes) -> float:
    """The length of audio that `check_audio_bytes` accepted."""
    info = sf.info(io.BytesIO(data))
    return info.frames / info.samplerate if info.samplerate else 0.0


async def read_upload(upload: UploadFile | StarletteUpload, config: ServeConfig, what: str) -> bytes:
    """An uploaded file's bytes, reading at most one byte past the limit."""
    data = await upload.read(config.max_upload_bytes + 1)
    return check_audio_bytes(data, config, what)


async def read_body(request: Request, config: ServeConfig, audio_fields: tuple[str, ...]) -> tuple[dict[str, Any],
                                                                                                   dict[str, bytes]]:
    """(plain fields, audio fields as bytes) from a JSON or multipart/urlencoded body.

    In JSON, audio fields are base64 strings (or data: URLs); in a form they are file parts (or base64 text).
    Empty form values count as absent, as HTML forms send them for blank inputs.
    """
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    audio: dict[str, bytes] = {}
    if ctype in ("multipart/form-data", "application/x-www-form-urlencoded"):
        fields: dict[str, Any] = {}
        async with request.form(max_files=4, max_fields=64, max_part_size=config.max_body_bytes) as form:
            for key, value in form.multi_items():
                if isinstance(value, StarletteUpload):
                    if key not in audio_fields:
                        raise InputError(f"unexpected file field {key!r}; files go in: {', '.join(audio_fields)}")
                    audio[key] = await read_upload(value, config, key)
                elif value != "":
                    fields[key] = value
    elif ctype in ("application/json", ""):
        try:
            fields = await request.json()
        except ValueError:
            raise InputError("the request body is not valid JSON") from None
        except RecursionError:  # the parser recurses once per nesting level
            raise InputError("the JSON body is nested too deeply") from None
        if not isinstance(fields, dict):
            raise InputError("the JSON body must be an object")
    else:
        raise UnsupportedMedia(f"unsupported content type {ctype!r}; send application/json or multipart/form-data")
    for key in audio_fields:
        value = fields.pop(key, None)
        if isinstance(value, str) and value and key not in audio:
            audio[key] = check_audio_bytes(decode_base64_audio(value, config.max_upload_bytes), config, key)
        elif value not in (None, ""):
            raise InputError(f"{key} must be a base64 string (JSON) or a file (multipart)")
    return fields, audio
