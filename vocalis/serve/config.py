"""Server settings: limits, timeouts, who may connect, the optional API key and where saved voices live."""

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

    max_input_chars: the cap on every text field of every route (input, tts_text, instructions/instruct_text,
        ref_text/prompt_text, a voice's transcript, a WebSocket session's text pieces together); OpenAI's 4096.
    max_prompt_tokens: the LLM prompt a request may make (prompt text or instruction + text + prompt speech
        tokens), counted before the job is queued.
    max_upload_bytes: decoded reference/source audio (a 30 s prompt as 16-bit 48 kHz stereo WAV is ~5.8 MB).
    max_body_bytes: whole request bodies (base64 inflates uploads by 4/3, plus form/JSON overhead).
    retry_after_s: what a 503 (queue full) tells the client to wait.
    queue_timeout_s: a job not started this long after it was queued is aborted: 503.
    request_timeout_s: a job running longer than this is aborted: 504.
    ws_idle_timeout_s: a WebSocket session that sends no message for this long (before "end") is closed (4408).
    ws_max_duration_s: the longest a WebSocket session may last, start to done (4504 when it is over).
    header_timeout_s / body_timeout_s: a request's head, and its body, must arrive within this (else 408).
    shutdown_grace_s: after SIGTERM, running streams get this long to finish; what has not started gets 503.
    max_saved_voices: saved voices the folder may hold; creating one more is a 409.
    bind_host: the address the server listens on (allowed as a Host header besides the loopback names).
    allowed_hosts: more Host header names to accept ("*": any; the default protects against DNS rebinding).
    allowed_origins: more browser origins (`https://app.example`, "*": any) that may call the API; pages served
        from an allowed host always may.
    api_key: when set, every route but /health and the web page needs `Authorization: Bearer <key>`.
    model_name: what /health, /v1/models and error messages call the model (never its filesystem path).
    voice_aliases: extra name -> voice mappings, consulted before the automatic OpenAI-name mapping.
    voice_adapters: voice name -> LoRA adapter (`--voice-adapter`), for requests that name no adapter.
    """

    max_input_chars: int = 4096
    max_prompt_tokens: int = 3072
    max_upload_bytes: int = 10 * 1024 * 1024
    max_body_bytes: int = 16 * 1024 * 1024
    retry_after_s: int = 2
    queue_timeout_s: float = 120.0
    request_timeout_s: float = 300.0
    ws_idle_timeout_s: float = 30.0
    ws_max_duration_s: float = 600.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    shutdown_grace_s: float = 10.0
    max_saved_voices: int = 1000
    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    api_key: str | None = None
    model_name: str = "vocalis"
    voices_dir: Path | None = None  # None: saved voices live in memory only (tests, throwaway servers)
    voice_aliases: dict[str, str] = field(default_factory=dict)
    voice_adapters: dict[str, str] = field(default_factory=dict)  # voice name -> the LoRA adapter it speaks with
    web_page: bool = True
    trim_silence: bool = False  # a response's trailing silence trimmed, its end faded (`vocalis.audio_trim`);
    # `vocalis serve` turns it on (--keep-silence: off); here off, so a response is the engine's audio as made

    def __post_init__(self) -> None:
        if self.max_input_chars < 1 or self.max_upload_bytes < 1 or self.max_body_bytes < self.max_upload_bytes:
            raise ValueError("limits must be positive and max_body_bytes >= max_upload_bytes")
        if self.max_prompt_tokens < 1 or self.max_saved_voices < 0:
            raise ValueError("max_prompt_tokens must be positive and max_saved_voices >= 0")
        times = (self.queue_timeout_s, self.request_timeout_s, self.ws_idle_timeout_s, self.ws_max_duration_s,
                 self.header_timeout_s, self.body_timeout_s, self.shutdown_grace_s)
        if any(t < 0 for t in times):
            raise ValueError("timeouts and the shutdown grace must be >= 0")
