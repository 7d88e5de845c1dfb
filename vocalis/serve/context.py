"""What every route reads from `request.app.state.ctx`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import HTTPConnection

from vocalis.serve.backend import Backend
from vocalis.serve.config import ServeConfig
from vocalis.serve.deadlines import Shutdown
from vocalis.serve.guards import ApiKey
from vocalis.serve.limits import PromptBudget
from vocalis.serve.metrics import ServeMetrics
from vocalis.serve.voices import VoiceStore

if TYPE_CHECKING:
    from vocalis.frontend.request import Voice


@dataclass
class ServerContext:
    backend: Backend
    config: ServeConfig
    voices: VoiceStore
    metrics: ServeMetrics
    api_key: ApiKey
    budget: PromptBudget
    shutdown: Shutdown = field(default_factory=Shutdown)
    hidden: tuple[tuple[str, str], ...] = ()  # (text, replacement) kept out of answers: the model's path

    def public(self, message: str) -> str:
        """`message` as a client may see it: where the model lives replaced by its name."""
        for text, replacement in self.hidden:
            if text:
                message = message.replace(text, replacement)
        return message

    def adapter_for(self, requested: str | None, voice: Voice | None) -> str | None:
        """The LoRA adapter a request speaks with: the one it names, else its voice's (`--voice-adapter`), else none
        (the base model); InputError (a 400) for one the server did not load."""
        adapter = requested or (self.config.voice_adapters.get(voice.name) if voice is not None else None)
        self.backend.check_adapter(adapter)
        return adapter

    @property
    def model_label(self) -> str:
        return f"{self.config.model_name} model"

    @property
    def clone_blocker(self) -> str:
        """Why the backend cannot make voices from audio."""
        return self.backend.clone_blocker


def ctx_of(conn: HTTPConnection) -> ServerContext:
    """The context of the app serving an HTTP request or a WebSocket."""
    return conn.app.state.ctx
