"""The proxy's HTTP server: uvicorn with the front door's limits on connections.

uvicorn closes a connection that stays idle between requests (``timeout_keep_alive``), but one
that sends half a request's headers, or its body a byte at a time, stays open for as long as its
client likes: twenty such clients hold twenty connections forever (slowloris). So the protocol
here gives each request a deadline for its headers, counted from the connection's start or its
first byte (``header_timeout_s``), and one for its body, counted from the end of its headers
(``body_timeout_s``); a request past either is cut off (the connection closed), and a request line
plus headers of more than 64 KiB is answered 431. ``max_connections`` bounds the connections and
requests served at once: a request past it is answered 503 (uvicorn's ``limit_concurrency``). The body's size is
the app's to bound (``--max-body-mb``, ``proxy.api._door``). All of them: docs/OPERATIONS.md.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy import Settings

MAX_HEADER_BYTES = 64 * 1024
_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 36\r\nconnection: close\r\n\r\nThe request's headers are too large."
)


class TimedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a deadline for each request's headers and one for its body."""

    header_timeout_s = 15.0
    body_timeout_s = 60.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        super().connection_made(transport)
        self._arm(self.header_timeout_s)  # the first request's headers, from the connection's start

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        if self._deadline is None:  # a kept-alive connection's next request: its headers from their first byte
            self._arm(self.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._arm(self.body_timeout_s)  # a request without a body completes at once, and disarms it
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _count(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self.transport.write(_TOO_LARGE)
            self.transport.close()

    def _arm(self, delay_s: float) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(delay_s, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        """The request's headers or body did not arrive in time: the connection goes (its call sees a disconnect)."""
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def timed_protocol(settings: Settings) -> type[TimedHttpToolsProtocol]:
    """The protocol class with ``settings``' deadlines (uvicorn builds one instance per connection)."""
    deadlines: dict[str, Any] = {
        "header_timeout_s": settings.header_timeout_s,
        "body_timeout_s": settings.body_timeout_s,
    }
    return type("TimedHttpToolsProtocol", (TimedHttpToolsProtocol,), deadlines)


def server_config(app: Any, settings: Settings, *, log_level: str = "info", loop: str = "uvloop") -> uvicorn.Config:
    """uvicorn's configuration for ``app`` on ``settings``' address, with the limits of the module's docstring."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop=loop,
        http=timed_protocol(settings),
        limit_concurrency=settings.max_connections + 1,  # uvicorn refuses the request that makes the count reach it
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=30,
    )
