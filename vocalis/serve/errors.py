"""How a failure reaches a client: the serving errors, the HTTP status of every error, and a WebSocket close
reason that fits its frame."""

from __future__ import annotations

from vocalis.errors import AudioError, InputError, VocalisError
from vocalis.serve.schemas import PayloadTooLarge
from vocalis.serve.uploads import UnsupportedMedia
from vocalis.serve.voices import VoiceConflict

# A close frame's payload is at most 125 bytes: the 2-byte code and a UTF-8 reason of at most 123 bytes.
CLOSE_REASON_BYTES = 123


class Overloaded(VocalisError):
    """The queue is full or a job waited too long to start: retry later (HTTP 503 + Retry-After)."""


class JobTimeout(VocalisError):
    """A job ran past its time limit (HTTP 504)."""


class Aborted(VocalisError):
    """The job was aborted (client gone, or `abort`)."""


def error_status(exc: BaseException) -> int:
    """The HTTP status an exception answers with (WebSocket sessions close with 4000 + it)."""
    if isinstance(exc, PayloadTooLarge):
        return 413
    if isinstance(exc, UnsupportedMedia):
        return 415
    if isinstance(exc, VoiceConflict):
        return 409
    if isinstance(exc, (InputError, AudioError)):
        return 400
    if isinstance(exc, Overloaded):
        return 503
    if isinstance(exc, JobTimeout):
        return 504
    if isinstance(exc, Aborted):
        return 499
    return 500


def close_reason(message: str) -> str:
    """`message` cut to fit a close frame: at most 123 UTF-8 bytes, never inside a character (a reason cut
    mid-character, or one over the limit, breaks the frame and the client sees 1006 instead of the code)."""
    return message.encode()[:CLOSE_REASON_BYTES].decode("utf-8", "ignore")
