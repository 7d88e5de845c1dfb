"""What stands in front of the routes: the body-size limit, the optional API key, per-request metrics."""

from __future__ import annotations

import json
import secrets
from typing import Any

from fastapi import HTTPException, Request, WebSocket
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vocalis.serve.metrics import ServeMetrics
from vocalis.serve.schemas import error_body


class BodyLimitMiddleware:
    """413 for bodies over `max_bytes`: at once from Content-Length, else while a chunked body is read."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        message = f"request body is larger than the {limit // (1024 * 1024)} MiB limit"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            body = json.dumps(error_body(message, code="payload_too_large")).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, message)
            return msg

        await self.app(scope, limited, send)


class RequestMetricsMiddleware:
    """Counts every HTTP response by route template and status (WebSockets count themselves)."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def watch(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, watch)
        finally:
            self.metrics.requests.labels(route_label(scope), str(status)).inc()


def route_label(scope: Scope | dict[str, Any]) -> str:
    """The route template (`/v1/audio/voices/{name}`), never the raw path, so labels stay few."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class ApiKey:
    """`Authorization: Bearer <key>` check; a no-op when no key is configured."""

    def __init__(self, key: str | None) -> None:
        self.key = key

    def _ok(self, header: str | None, query: str | None = None) -> bool:
        if self.key is None:
            return True
        given = query
        if header and header.lower().startswith("bearer "):
            given = header[7:].strip()
        return given is not None and secrets.compare_digest(given.encode(), self.key.encode())

    async def __call__(self, request: Request) -> None:
        """FastAPI dependency for HTTP routes."""
        if not self._ok(request.headers.get("authorization")):
            raise HTTPException(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                headers={"WWW-Authenticate": "Bearer"})

    def websocket_ok(self, ws: WebSocket) -> bool:
        """Browsers cannot set headers on a WebSocket, so `?api_key=` is accepted there too."""
        return self._ok(ws.headers.get("authorization"), ws.query_params.get("api_key"))
