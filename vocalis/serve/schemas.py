"""Request and message schemas of the HTTP and WebSocket APIs (pydantic), and the error body.

`SpeechRequest` is OpenAI's `POST /v1/audio/speech` body plus Vocalis extensions (input_format, ref_audio, ref_text,
seed, language, stream, timestamps). Unknown fields are rejected, so a misspelt option fails loudly instead of being ignored.
Text lengths are checked by the routes against the server's one limit (limits.py), not here.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from vocalis.errors import InputError
from vocalis.frontend.request import MAX_SPEED, MIN_SPEED
from vocalis.frontend.text import LANGUAGES

MAX_SEED = 2**62
ResponseFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]


class VoiceRef(BaseModel):
    """OpenAI's newer `voice: {"id": ...}` form."""

    model_config = ConfigDict(extra="forbid")
    id: str


class SynthesisOptions(BaseModel):
    """Fields every synthesis request shares."""

    model_config = ConfigDict(extra="forbid")

    speed: float = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="fixes the sampling for reproducible output")
    language: str = Field("auto", description="text normalisation language: " + ", ".join(LANGUAGES))

    @field_validator("language")
    @classmethod
    def _language(cls, value: str) -> str:
        if value not in LANGUAGES:
            raise ValueError(f"language must be one of {', '.join(LANGUAGES)}")
        return value


class SpeechRequest(SynthesisOptions):
    """`POST /v1/audio/speech` (JSON, or multipart form with `ref_audio` as a file)."""

    model: str = Field("vocalis", description="accepted for compatibility (tts-1, gpt-4o-mini-tts, ...); one model is served")
    input: str = Field(..., min_length=1)
    input_format: Literal["text", "ssml"] = Field("text", description="ssml: input is a <speak> document (a subset)")
    voice: str | VoiceRef | None = Field(None, description="a saved or built-in voice, or an OpenAI voice name")
    instructions: str | None = Field(None, description="how to speak (instruct mode)")
    response_format: ResponseFormat = "mp3"
    stream_format: Literal["audio", "sse"] = "audio"
    ref_audio: str | None = Field(None, description="one-off reference clip: base64 or a data: URL (JSON body)")
    ref_text: str | None = Field(None, description="transcript of ref_audio (zero-shot cloning)")
    stream: bool = Field(True, description="false: synthesise the whole utterance, then send one exact file")
    adapter: str | None = Field(None, description="a LoRA adapter the server loaded (default: the voice's, else none)")
    timestamps: bool = Field(False, description="word timestamps: speech.word events (sse), else one JSON body "
                             "{audio, response_format, sample_rate, words}")

    @property
    def voice_name(self) -> str | None:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice


class WsStart(SynthesisOptions):
    """First WebSocket message: `{"type": "start", ...}`."""

    type: Literal["start"]
    voice: str | None = None
    instructions: str | None = None
    response_format: Literal["pcm", "wav", "mp3", "opus", "flac", "aac"] = "pcm"
    adapter: str | None = None  # a LoRA adapter the server loaded (default: the voice's, else none)


class WsText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class WsEnd(BaseModel):
    """End of input: no more text will come; the server finishes the audio and closes."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["end"]


class WsCancel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["cancel"]


def decode_base64_audio(value: str, limit: int) -> bytes:
    """base64 or `data:audio/...;base64,...` -> bytes, with the size limit checked before decoding."""
    payload = value.split(",", 1)[1] if value.startswith("data:") else value
    if len(payload) * 3 // 4 > limit:
        raise PayloadTooLarge(f"ref_audio is larger than the {limit // (1024 * 1024)} MiB limit")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InputError(f"ref_audio is not valid base64 ({exc})") from None


class PayloadTooLarge(InputError):
    """HTTP 413."""


def validation_message(exc: ValidationError | Any) -> str:
    """Pydantic errors -> one readable line: `field: problem; field: problem`."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body",)) or "body"
        msg = err.get("msg", "invalid")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{where}: {msg}")
    return "; ".join(parts) or "invalid request"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, so its clients surface the message."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
