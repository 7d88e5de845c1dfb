"""Server settings: limits, timeouts, the optional API key and where saved voices live."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


def default_voices_dir() -> Path:
    """Saved voices are user data: `$XDG_DATA_HOME/vocalis/voices` (default `~/.local/share/...`)."""
    import os

    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "vocalis" / "voices"


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything `create_app` needs besides the backend. Defaults suit one CPU machine.

    max_input_chars: OpenAI's limit for `input`.
    max_upload_bytes: decoded reference/source audio (a 30 s prompt as 16-bit 48 kHz stereo WAV is ~5.8 MB).
    max_body_bytes: whole request bodies (base64 inflates uploads by 4/3, plus form/JSON overhead).
    retry_after_s: what a 503 (queue full) tells the client to wait.
    ws_idle_timeout_s: a WebSocket session that sends no text for this long is ended.
    api_key: when set, every route but /health and the web page needs `Authorization: Bearer <key>`.
    voice_aliases: extra name -> voice mappings, consulted before the automatic OpenAI-name mapping.
    """

    max_input_chars: int = 4096
    max_upload_bytes: int = 10 * 1024 * 1024
    max_body_bytes: int = 16 * 1024 * 1024
    retry_after_s: int = 2
    ws_idle_timeout_s: float = 30.0
    api_key: str | None = None
    voices_dir: Path | None = None  # None: saved voices live in memory only (tests, throwaway servers)
    voice_aliases: dict[str, str] = field(default_factory=dict)
    web_page: bool = True

    def __post_init__(self) -> None:
        if self.max_input_chars < 1 or self.max_upload_bytes < 1 or self.max_body_bytes < self.max_upload_bytes:
            raise ValueError("limits must be positive and max_body_bytes >= max_upload_bytes")
