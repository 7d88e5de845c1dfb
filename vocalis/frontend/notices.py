"""Notes for the caller about how its request was read (a word spelled out or skipped, a symbol dropped): whatever
prepares a request may `notice(...)`, and whoever prepares it on a caller's behalf collects them
(`collect_notices`) and hands them back with the audio (the server's `X-Vocalis-Warnings` header and SSE event).

A notice is for the caller, not an error: the request goes on. Collection is per thread of preparation (a context
variable), so concurrent requests never see each other's notices; outside a collection a notice is only logged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

log = logging.getLogger(__name__)
_collected: ContextVar[list[str] | None] = ContextVar("vocalis_notices", default=None)


def notice(message: str) -> None:
    """Tell the caller of the request being prepared (once per distinct message)."""
    log.info("%s", message)
    notices = _collected.get()
    if notices is not None and message not in notices:
        notices.append(message)


@contextmanager
def collect_notices(into: list[str] | None = None) -> Iterator[list[str]]:
    """The notices given inside the block, in order, appended to `into` (default: a new list). Tasks created
    inside the block keep collecting after it, as they keep its context."""
    notices: list[str] = [] if into is None else into
    token = _collected.set(notices)
    try:
        yield notices
    finally:
        _collected.reset(token)
