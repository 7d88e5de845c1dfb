"""What every route reads from `request.app.state.ctx`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import HTTPConnection

from vocalis.serve.config import ServeConfig
from vocalis.serve.guards import ApiKey
from vocalis.serve.metrics import ServeMetrics
from vocalis.serve.voices import VoiceStore


@dataclass
class ServerContext:
    backend: Any  # ThreadedBackend or anything with its surface
    config: ServeConfig
    voices: VoiceStore
    metrics: ServeMetrics
    api_key: ApiKey


def ctx_of(conn: HTTPConnection) -> ServerContext:
    """The context of the app serving an HTTP request or a WebSocket."""
    return conn.app.state.ctx
