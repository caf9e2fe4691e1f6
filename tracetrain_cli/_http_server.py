"""The proxy's HTTP server: uvicorn with the front door's limits on connections.

uvicorn closes a connection that stays idle between requests (``timeout_keep_alive``), but one
that sends half a request's headers, or its body a byte at a time, stays open for as long as its
client likes: twenty such clients hold twenty connections forever (slowloris). So the protocol
here gives each request a deadline for its headers, counted from the connection's start or its
first byte (``header_timeout_s``), and one for its body, counted from the end of its headers
(``body_timeout_s``); a request past either is cut off within a second (the connection closed),
and a request line plus headers of more than 64 KiB is answered 431. ``max_connections`` bounds the
connections and requests served at once: a request past it is answered 503 (uvicorn's
``limit_concurrency``). The body's size is the app's to bound (``--max-body-mb``, ``proxy.api._door``: 413
from the ``Content-Length``, before the body is read). ``X-Forwarded-For`` is believed only from the proxies
``forwarded_allow_ips`` names (none by default). All of them: docs/OPERATIONS.md.

A stream learns that its client hung up from the connection itself (the ``proxy.HANG_UP`` extension:
its callback runs when the connection is lost), instead of a task of its own listening on ``receive()``.

A connection answered and closed before its request was read whole (the 431, the 413, a 503, any
``Connection: close`` answer to a request still arriving) closes as HTTP servers close it, lingering:
the server's half ends (FIN) after the answer, and what the client still sends is read and dropped
until it closes, or ``LINGER_S`` pass with nothing arriving (``LINGER_MAX_S`` in all). Closed at once
with the client's bytes unread, the kernel would reset the connection, and a client still sending (as
an SDK sends a body whole before it reads) would see the reset instead of the answer.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any, cast

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from proxy import HANG_UP, Settings

MAX_HEADER_BYTES = 64 * 1024
# A lingering close (the module's docstring), as Apache's: it ends once the client sends nothing for LINGER_S, or
# LINGER_MAX_S after it began; the sweep closes it then, within a second.
LINGER_S = 2.0
LINGER_MAX_S = 30.0
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
        self._lingering_since: float | None = None  # the loop's clock when a lingering close began
        self._hang_ups: set[Callable[[], None]] = set()  # what runs when the connection is lost (``HANG_UP``)
        super().connection_made(transport)
        # uvicorn's closes (its request cycles' and its own) go through ``close_connection``.
        self._socket = transport
        self.transport = cast(asyncio.Transport, _ClosedByProtocol(transport, self))
        # The loop's clock by which the request under way must have sent its headers (or body); None: no
        # request is under way (between requests, uvicorn's keep-alive timeout watches the connection).
        self.deadline: float | None = self.loop.time() + self.header_timeout_s
        if self.server_state not in _swept:
            _swept.add(self.server_state)
            _sweep(self.loop, self.connections, weakref.ref(self.server_state))

    def data_received(self, data: bytes) -> None:
        if self._lingering_since is not None:  # dropped; the client has LINGER_S more to send the rest
            self.deadline = min(self.loop.time() + LINGER_S, self._lingering_since + LINGER_MAX_S)
            return
        if not self._reading_headers:
            super().data_received(data)
            return
        self._header_bytes += len(data)  # with a body's first bytes at times: judged once the headers are in
        super().data_received(data)
        if self._reading_headers and self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self.transport.write(_TOO_LARGE)
            self._linger()

    @property
    def lingering(self) -> bool:
        return self._lingering_since is not None

    def close_connection(self) -> None:
        """uvicorn closes the connection: lingering if the request's answer is out and its body still arriving."""
        if self.lingering or self._socket.is_closing():
            return
        if not self._reading_headers and self.cycle is not None and self.cycle.response_complete:
            self._linger()
        else:
            self._socket.close()

    def _linger(self) -> None:
        """A lingering close (the module's docstring): the server's half ends, what arrives is read and dropped."""
        self._lingering_since = self.loop.time()
        self.deadline = self._lingering_since + LINGER_S
        self.flow.resume_reading()  # paused while the body waited for the app, which will not read it now
        if self._socket.can_write_eof():
            self._socket.write_eof()

    def close_now(self) -> None:
        """Close the socket, lingering or not (the sweep, past a deadline)."""
        if not self._socket.is_closing():
            self._socket.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {HANG_UP: {"tell": self._tell_on_hang_up}}
        if self.deadline is None:  # a kept-alive connection's next request: its headers from their first byte
            self.deadline = self.loop.time() + self.header_timeout_s

    def _tell_on_hang_up(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run ``callback`` when the connection is lost; returns the function that takes it back (nothing once it
        ran: a stream takes it back as it ends, however it ended)."""
        hang_ups = self._hang_ups
        hang_ups.add(callback)
        return lambda: hang_ups.discard(callback)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        hang_ups, self._hang_ups = self._hang_ups, set()
        for callback in hang_ups:
            callback()

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        self.deadline = self.loop.time() + self.body_timeout_s  # a request without a body completes at once
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._reading_headers, self._header_bytes, self.deadline = True, 0, None
        super().on_message_complete()


class _ClosedByProtocol:
    """A connection's transport as uvicorn sees it: closing it is the protocol's ``close_connection``; lingering,
    it is closing already.

    A response's head leaves with the first bytes of its body: uvicorn writes each in a ``write`` of its own, and
    each is a system call (a non-streamed answer's head and body, 2 -> 1). The head is held only until the loop's
    next turn, so a stream whose first event is not ready yet still sends its head at once.
    """

    def __init__(self, transport: asyncio.Transport, protocol: TimedHttpToolsProtocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._held: bytes | None = None  # a response's head, not written yet
        self._headed: object = None  # the request cycle whose head was held last

    def write(self, data: bytes) -> None:
        if self._held is not None:
            data, self._held = self._held + data, None
        else:
            cycle = self._protocol.cycle
            if cycle is not None and cycle.response_started and cycle is not self._headed and data:
                # uvicorn's first write once a cycle's response started is its status line and headers
                self._headed, self._held = cycle, data
                self._protocol.loop.call_soon(self.flush)
                return
        self._transport.write(data)

    def flush(self) -> None:
        """Write a held head (nothing followed it in the same turn of the loop)."""
        if self._held is not None:
            held, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._protocol.close_connection()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:  # write and the rest: the transport's, kept (0.5 -> 0.07 us a write)
        value = getattr(self._transport, name)
        setattr(self, name, value)
        return value


# The servers whose connections are swept (each has one sweep a second while it lives).
_swept: weakref.WeakSet[ServerState] = weakref.WeakSet()


def _sweep(loop: asyncio.AbstractEventLoop, connections: set[Any], server: weakref.ref[ServerState]) -> None:
    """Close the connections whose request is past its deadline (its call sees a disconnect); again in a second."""
    now = loop.time()
    late = [c for c in connections if isinstance(c, TimedHttpToolsProtocol) and c.deadline is not None
            and c.deadline < now]  # fmt: skip
    for connection in late:
        connection.deadline = None
        connection.close_now()
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
        # X-Forwarded-For names the client only when the operator named the proxy that sent it: uvicorn's default
        # believes any loopback sender, which would let a local process pick its address (and dodge the throttle).
        proxy_headers=bool(settings.forwarded_allow_ips),
        forwarded_allow_ips=list(settings.forwarded_allow_ips) or None,
    )
