"""The proxy's HTTP server: uvicorn with the front door's limits on connections.

uvicorn closes a connection that stays idle between requests (``timeout_keep_alive``), but one
that sends half a request's headers, or its body a byte at a time, stays open for as long as its
client likes: twenty such clients hold twenty connections forever (slowloris). So the protocol
here gives each request a deadline for its headers, counted from the connection's start or its
first byte (``header_timeout_s``), and one for its body, counted from the end of its headers
(``body_timeout_s``); a request past either is cut off within a second (the connection closed),
and a request line plus headers of more than 64 KiB is answered 431 (a lingering close). ``max_connections``
bounds the connections and requests served at once: a request past it is answered 503 (uvicorn's
``limit_concurrency``). The body's size is the app's to bound (``--max-body-mb``, ``proxy.api._door``). All of
them: docs/OPERATIONS.md.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from proxy import Settings

MAX_HEADER_BYTES = 64 * 1024
# After a 431, how long what the client still sends is read and dropped before the connection closes (a lingering
# close, as Apache's: 2 s); the sweep closes it then, within a second.
LINGER_S = 2.0
_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 36\r\nconnection: close\r\n\r\nThe request's headers are too large."
)


class TimedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a deadline for each request's headers and one for its body.

    A request's only cost is a deadline written at its first byte, at the end of its headers and at
    its end (no timer of its own): one sweep a second per server closes the connections past theirs
    (uvicorn's own set of them).
    """

    header_timeout_s = 15.0
    body_timeout_s = 60.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._reading_headers = True
        self._header_bytes = 0
        self._refused = False  # answered 431: the rest of the request is read and dropped
        super().connection_made(transport)
        # The loop's clock by which the request under way must have sent its headers (or body); None: no
        # request is under way (between requests, uvicorn's keep-alive timeout watches the connection).
        self.deadline: float | None = self.loop.time() + self.header_timeout_s
        if self.server_state not in _swept:
            _swept.add(self.server_state)
            _sweep(self.loop, self.connections, weakref.ref(self.server_state))

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._reading_headers:
            super().data_received(data)
            return
        self._header_bytes += len(data)  # with a body's first bytes at times: judged once the headers are in
        super().data_received(data)
        if self._reading_headers and self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self._refuse()

    def _refuse(self) -> None:
        """Answer 431 and close as HTTP servers close on a request they refuse (a lingering close): the answer and
        the end of the server's half (FIN), then what the client still sends is read and dropped until it closes
        or ``LINGER_S`` pass. Closed at once with the client's bytes unread, the connection would be reset, and a
        client still sending its headers would see the reset instead of the answer."""
        self._refused = True
        self.transport.write(_TOO_LARGE)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.deadline = self.loop.time() + LINGER_S

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.deadline is None:  # a kept-alive connection's next request: its headers from their first byte
            self.deadline = self.loop.time() + self.header_timeout_s

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        self.deadline = self.loop.time() + self.body_timeout_s  # a request without a body completes at once
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._reading_headers, self._header_bytes, self.deadline = True, 0, None
        super().on_message_complete()


# The servers whose connections are swept (each has one sweep a second while it lives).
_swept: weakref.WeakSet[ServerState] = weakref.WeakSet()


def _sweep(loop: asyncio.AbstractEventLoop, connections: set[Any], server: weakref.ref[ServerState]) -> None:
    """Close the connections whose request is past its deadline (its call sees a disconnect); again in a second."""
    now = loop.time()
    late = [c for c in connections if isinstance(c, TimedHttpToolsProtocol) and c.deadline is not None
            and c.deadline < now]  # fmt: skip
    for connection in late:
        connection.deadline = None
        if not connection.transport.is_closing():
            connection.transport.close()
    if server() is not None and not loop.is_closed():
        loop.call_later(1.0, _sweep, loop, connections, server)


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
