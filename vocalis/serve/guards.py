"""What stands in front of the routes: the API key (checked before any body is read, and kept out of the
logs whatever its spelling), the body's size and time limits, and per-request metrics."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any
from urllib.parse import parse_qsl, urlencode

from fastapi import HTTPException, WebSocket
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vocalis.serve.metrics import ServeMetrics
from vocalis.serve.schemas import error_body

QUERY_KEY = "api_key"
SCOPE_KEY = "vocalis.query_api_key"  # where the key taken out of the query string is kept for the routes
# Paths anyone may fetch: liveness, the web page and its files, the API docs.
PUBLIC_PATHS = frozenset({"/health", "/", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
PUBLIC_PREFIXES = ("/web/",)


async def send_json_error(send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None,
                          close: bool = False) -> None:
    """An OpenAI-shaped JSON error, from a middleware (before any route ran)."""
    body = json.dumps(error_body(message, "invalid_request_error" if status < 500 else "server_error",
                                 code=str(status))).encode()
    extra = [(b"connection", b"close")] if close else []
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *extra, *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """413 for bodies over `max_bytes` (at once from Content-Length, else while a chunked body is read) and 408
    for a body that has not fully arrived `timeout_s` after the request began (one byte every few seconds would
    otherwise hold a connection for as long as the client likes)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 60.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        message = f"request body is larger than the {limit // (1024 * 1024)} MiB limit"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await send_json_error(send, 413, message, close=True)
            return
        seen = 0
        complete = False
        deadline = time.monotonic() + self.timeout_s

        async def limited() -> Message:
            nonlocal seen, complete
            if complete:  # after the body only a disconnect can come: no time limit on waiting for it
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {self.timeout_s:g} s",
                                    headers={"Connection": "close"}) from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                complete = not msg.get("more_body", False)
                if seen > limit:
                    raise HTTPException(413, message, headers={"Connection": "close"})
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

    def ok(self, header: str | None, query: str | None = None) -> bool:
        if self.key is None:
            return True
        given = query
        if header and header.lower().startswith("bearer "):
            given = header[7:].strip()
        return given is not None and secrets.compare_digest(given.encode(), self.key.encode())

    def websocket_ok(self, ws: WebSocket) -> bool:
        """Browsers cannot set headers on a WebSocket, so `?api_key=` is accepted there too."""
        return self.ok(ws.headers.get("authorization"), ws.scope.get(SCOPE_KEY))


def take_query_key(scope: Scope) -> None:
    """Move the API key out of the query string into `scope[SCOPE_KEY]`, in place, so that nothing reading the
    scope afterwards (the server's access log, error pages) sees it. The parameter is found whatever its case or
    percent-encoding (`API_KEY`, `api%5Fkey`): a query name is a client's spelling, and every spelling is a key."""
    query = scope.get("query_string", b"")
    if not query:
        return
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    given = [v for k, v in pairs if k.lower() == QUERY_KEY]
    if given:
        scope[SCOPE_KEY] = given[-1]
        scope["query_string"] = urlencode([(k, "REDACTED" if k.lower() == QUERY_KEY else v) for k, v in pairs]).encode()


class QueryKeyMiddleware:
    """Takes the API key out of every query string before anything else runs (see `take_query_key`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            take_query_key(scope)
        await self.app(scope, receive, send)


class ApiKeyMiddleware:
    """For HTTP, answers 401 before the route runs, i.e. before a byte of the body is read. WebSockets check the
    key in their route, after the handshake, so the client hears why (close 4401). A CORS preflight never gets
    here: browsers send it without credentials, and the CORS middleware in front answers it."""

    def __init__(self, app: ASGIApp, api_key: ApiKey) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._public(scope["path"]):
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            if not self.api_key.ok(header):
                await send_json_error(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                      [(b"www-authenticate", b"Bearer")], close=True)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _public(path: str) -> bool:
        return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)
