"""Who may talk to the server: the Host and Origin allow-lists, for HTTP and WebSocket alike.

Without them a web page the user visits can reach a server on their machine: by DNS rebinding (a name of the
attacker's that resolves to 127.0.0.1, so the browser sends `Host: evil.example`), or by a cross-site form POST
or WebSocket (the browser sends `Origin: https://evil.example`). Both checks hold with or without an API key.

Host: loopback names, the bound address, any IP literal when bound to all interfaces (an IP typed by the user
cannot be rebound), and `allowed_hosts` ("*" turns the check off). Origin, when a browser sends one: the
server's own origin (same scheme and Host), a page on a loopback host, or one of `allowed_origins` ("*": any).
Requests without an Origin (curl, SDKs, servers) are not browsers' and pass.

CORS: a page on another origin that passes the Origin check (a loopback page, or one of `allowed_origins`) gets
the CORS headers, on its preflight (answered before the API key is checked: browsers send preflights without
credentials) and on the response, so a web app can call the API and read its answers; `cors_options` says which.
"""

from __future__ import annotations

import ipaddress
import json
import re
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from vocalis.serve.errors import close_reason
from vocalis.serve.schemas import error_body

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# An origin on this machine: http(s), a loopback name (or a *.localhost name), any port.
LOOPBACK_ORIGIN = r"https?://(localhost|127\.0\.0\.1|\[::1\]|[a-z0-9.-]+\.localhost)(:[0-9]{1,5})?"
# What a web app may send and read beyond the CORS-safelisted headers.
CORS_METHODS = ("GET", "POST", "DELETE")
CORS_REQUEST_HEADERS = ("Authorization", "Content-Type")
CORS_EXPOSED_HEADERS = ("X-Sample-Rate", "X-First-Chunk-Latency", "X-Audio-Format", "X-RTF", "X-Vocalis-Warnings",
                        "Retry-After")
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})


def _hostname(host: str) -> str:
    """`Host` header value -> the lower-case name, without port or IPv6 brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostPolicy:
    """The allow-lists of one server."""

    def __init__(self, bind_host: str, allowed_hosts: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = ()):
        bind = _hostname(bind_host) if bind_host else ""
        self.any_host = "*" in allowed_hosts
        self.any_ip = bind in WILDCARD_BINDS
        self.hosts = LOOPBACK_NAMES | {_hostname(h) for h in allowed_hosts if h != "*"} | (
            {bind} if bind not in WILDCARD_BINDS else set())
        self.any_origin = "*" in allowed_origins
        self.origins = {o.strip().rstrip("/").lower() for o in allowed_origins if o != "*"}

    def host_ok(self, host: str | None) -> bool:
        if host is None or self.any_host:
            return True
        name = _hostname(host)
        if name in self.hosts or name.endswith(".localhost"):
            return True
        return self.any_ip and _is_ip(name)

    def origin_ok(self, origin: str | None, host: str | None, scheme: str) -> bool:
        if origin is None or self.any_origin:
            return True
        origin = origin.strip().rstrip("/").lower()
        if origin in self.origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (sandboxed frames, file: pages) and anything odd
        own_scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
        if host is not None and parts.netloc == host.strip().lower() and parts.scheme == own_scheme:
            return True  # same origin: the web page this server serves
        return re.fullmatch(LOOPBACK_ORIGIN, origin) is not None

    def cors_options(self) -> dict[str, object]:
        """Starlette's `CORSMiddleware` options for the origins this policy lets call the API from a page."""
        return {"allow_origins": ("*",) if self.any_origin else tuple(sorted(self.origins)),
                "allow_origin_regex": None if self.any_origin else LOOPBACK_ORIGIN,
                "allow_methods": CORS_METHODS, "allow_headers": CORS_REQUEST_HEADERS,
                "expose_headers": CORS_EXPOSED_HEADERS,
                # Chrome asks before a public page may reach a private address; the origin is allowed, so yes
                "allow_private_network": True}


class HostOriginMiddleware:
    """403 (HTTP) or a refused handshake (WebSocket) for a Host or Origin outside the allow-lists."""

    def __init__(self, app: ASGIApp, policy: HostPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k: v for k, v in scope["headers"] if k in (b"host", b"origin")}
        host = headers[b"host"].decode("latin-1") if b"host" in headers else None
        origin = headers[b"origin"].decode("latin-1") if b"origin" in headers else None
        if not self.policy.host_ok(host):
            problem = f"host {host!r} is not allowed here (start the server with --allowed-hosts to allow it)"
        elif not self.policy.origin_ok(origin, host, scope.get("scheme", "http")):
            problem = f"origin {origin!r} is not allowed here (start the server with --allowed-origins to allow it)"
        else:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # closing before accept refuses the handshake (HTTP 403)
            await send({"type": "websocket.close", "code": 4403, "reason": close_reason(problem)})
            return
        body = json.dumps(error_body(problem, code="403")).encode()
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
