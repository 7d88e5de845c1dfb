"""Running the app under uvicorn with the limits uvicorn lacks: a time limit on a request's head, and a bounded
drain on SIGTERM.

- Head timeout: a connection must deliver a complete request head within `header_timeout_s` of opening, or of
  its previous response (keep-alive), else it gets a 408 and is closed; a slow-loris client sending a byte now
  and then would otherwise hold a connection for ever. The body's time limit is `BodyLimitMiddleware`'s.
- Drain: on SIGTERM/SIGINT uvicorn stops accepting connections and waits for the open ones; the app's
  `Shutdown` is told at once, refuses new work (503), and after `shutdown_grace_s` ends every job still
  running (503 where no audio was sent yet). uvicorn's own limit, a little later, cancels whatever is left.

The protocol wraps whichever HTTP implementation uvicorn would pick (httptools when installed, else h11).
"""

from __future__ import annotations

import asyncio
import socket
from functools import cache
from typing import Any

import uvicorn

GRACE_MARGIN_S = 2.0  # uvicorn's last resort, after the app's own grace: time for the 503s to go out
_REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                    b"content-length: 40\r\nconnection: close\r\n\r\nthe request head did not arrive in time")


@cache
def timed_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with a head timeout (one class per timeout value)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeadTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            if self.transport is not None and not self.transport.is_closing():
                self._head_timer = asyncio.get_running_loop().call_later(header_timeout_s, self._head_expired)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            transport = self.transport
            if transport is None or transport.is_closing() or transport.get_protocol() is not self:
                return  # closed, or upgraded to a WebSocket (which has its own limits)
            cycle = getattr(self, "cycle", None)
            if cycle is not None and not cycle.response_complete:
                return  # a request is in progress: its head arrived in time
            transport.write(_REQUEST_TIMEOUT)
            transport.close()

    return HeadTimeoutProtocol


class VocalisServer(uvicorn.Server):
    """uvicorn's server, telling the app when shutdown begins so its grace period starts then."""

    def __init__(self, config: uvicorn.Config, app: Any, grace_s: float) -> None:
        super().__init__(config)
        self.vocalis_app = app
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        ctx = getattr(self.vocalis_app.state, "ctx", None)
        if ctx is not None:
            ctx.shutdown.begin(self.grace_s)
        await super().shutdown(sockets)


def make_server(app: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                **uvicorn_options: Any) -> VocalisServer:
    """A server for `create_app(...)`'s app with the limits of its `ServeConfig`."""
    config = app.state.ctx.config
    options = {"timeout_graceful_shutdown": int(config.shutdown_grace_s + GRACE_MARGIN_S + 0.999),
               **uvicorn_options}
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                               http=timed_protocol(config.header_timeout_s), **options)
    return VocalisServer(uv_config, app, config.shutdown_grace_s)
