"""A lean HTTP/1.1 client for the two calls on every agent's path: POST a JSON body, read the answer.

Why not a general client: per call, aiohttp (and httpx before it) builds URL objects, header
multidicts, cookie jars, timers and tracing hooks the proxy never uses; measured one exchange
after another against the same fake vLLM, aiohttp took 470-670 µs and a kept asyncio connection
290-440 µs (docs/BENCHMARKS.md, issue 14). What is left here is small: the request head is
formatted once per call, responses are parsed by ``httptools`` (llhttp, uvicorn's parser:
status, headers, Content-Length and chunked bodies), and connections are kept in a pool per
upstream, newest first.

One exchange at a time per connection. A response read to its end goes back to the pool unless
the server said ``Connection: close``; one released early (the client hung up mid-stream) is
closed, which is how vLLM learns to stop generating. A kept connection the server closed while
idle (uvicorn's keep-alive timeout) leaves the pool when its close arrives; a request that
races that close, and got not a byte back, is sent once more on a new connection.

``timeout_s`` bounds each wait for bytes, not a whole stream: a long generation that keeps
sending is never cut off. Errors: ``ConnectFailed`` (nothing was sent: the router may try
another server), ``TimeoutError``, ``TransportError`` (the connection broke or spoke no HTTP).
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections import deque
from typing import cast
from urllib.parse import unquote, urlsplit

import httptools

# A stream's unread body past this pauses reading from the socket (TCP then slows the server).
_HIGH_WATER = 256 * 1024


class TransportError(ConnectionError):
    """The connection to the upstream broke, or what came back was not HTTP."""


class ConnectFailed(TransportError):
    """No connection could be made, so nothing was sent."""


class _Stale(TransportError):
    """A kept connection was closed before a byte of the answer came back (safe to send again)."""


class Exchange:
    """One response: ``status`` is known; read its body with ``read`` or ``next_chunk``, then ``release``."""

    __slots__ = ("_connection", "status")

    def __init__(self, connection: _Connection, status: int) -> None:
        self._connection = connection
        self.status = status

    async def read(self) -> bytes:
        """The whole body."""
        chunks = []
        while chunk := await self.next_chunk():
            chunks.append(chunk)
        return b"".join(chunks)

    async def next_chunk(self) -> bytes:
        """The body's bytes that arrived since the last call, waiting for some; b"" once the body ended."""
        connection = self._connection
        while not (chunk := connection.take()) and not connection.complete:
            await connection.wait()
        return chunk

    async def finish(self, within_s: float) -> None:
        """Read what is left of a body whose end is due (a stream after its last event), so the connection
        is kept; if it does not end within ``within_s``, ``release`` closes it."""
        connection = self._connection
        connection.take()
        if connection.complete:
            return  # the end came with the last event (most streams): no timer to set
        try:
            async with asyncio.timeout(within_s):
                while await self.next_chunk():
                    pass
        except (TimeoutError, TransportError):
            pass

    def release(self) -> None:
        """Give the connection back (read to its end) or close it (anything left unread)."""
        self._connection.release()


class Http1Pool:
    """Kept HTTP/1.1 connections to one upstream (``base_url``: ``http(s)://host:port/prefix``)."""

    def __init__(self, base_url: str, *, timeout_s: float, connect_timeout_s: float = 5.0) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"an upstream must be an http(s) URL, got {base_url!r}")
        self._host = url.hostname
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        self._prefix = url.path.rstrip("/").encode()
        head = [b"Host: " + url.netloc.rpartition("@")[2].encode(), b"Content-Type: application/json"]
        if url.username is not None:
            user = f"{unquote(url.username)}:{unquote(url.password or '')}".encode()
            head.append(b"Authorization: Basic " + base64.b64encode(user))
        self._head = b"\r\n".join(head) + b"\r\n"
        self.timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []  # newest last
        self._open: set[_Connection] = set()

    async def post(self, path: str, body: bytes) -> Exchange:
        """POST ``body`` (JSON) to the prefix + ``path``; returns once the status line and headers arrived."""
        request = b"POST %s%s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s" % (
            self._prefix, path.encode(), self._head, len(body), body,
        )  # fmt: skip
        while self._idle:
            connection = self._idle.pop()
            try:
                return await _sent(connection, request)
            except _Stale:
                continue  # closed by the server while idle: the request never reached it
        connection = await self._connect()
        try:
            return await _sent(connection, request)
        except _Stale as exc:
            raise TransportError(str(exc)) from exc

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self), self._host, self._port, ssl=self._ssl
                )
        except TimeoutError as exc:
            raise ConnectFailed(f"no connection to {self._host}:{self._port} in {self._connect_timeout_s:g} s") from exc
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {self._host}:{self._port}: {exc}") from exc
        self._open.add(connection)
        return connection

    def _keep(self, connection: _Connection) -> None:
        self._idle.append(connection)

    def _forget(self, connection: _Connection) -> None:
        self._open.discard(connection)
        if connection in self._idle:
            self._idle.remove(connection)

    def close(self) -> None:
        """Close every connection (those in use too)."""
        for connection in list(self._open):
            connection.abort()
        self._idle.clear()


async def _sent(connection: _Connection, request: bytes) -> Exchange:
    """``request`` sent on ``connection``; closed if the answer's head never comes (an error, a cancel)."""
    try:
        return await connection.send(request)
    except BaseException:
        connection.abort()
        raise


class _Connection(asyncio.Protocol):
    """One kept connection; ``httptools`` calls the ``on_*`` methods as it parses a response."""

    def __init__(self, pool: Http1Pool) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._busy = False  # an exchange is under way
        self._received = False  # a byte of this exchange's answer came back
        self._headers_done = False
        self._length_known = False  # Content-Length or chunked: the body does not end with the connection
        self._keep_alive = False  # the server keeps the connection open after this answer
        self.complete = False
        self._error: TransportError | None = None
        self._closed = False
        self._deadline = 0.0  # the loop's clock by which the wait under way must get bytes
        self._timer: asyncio.TimerHandle | None = None

    # -- the exchange, as Exchange and Http1Pool drive it --

    async def send(self, request: bytes) -> Exchange:
        assert self._transport is not None and not self._busy
        if self._closed:
            raise _Stale("the kept connection was closed")
        self._busy = True
        self._received = self._headers_done = self._length_known = self._keep_alive = self.complete = False
        self._transport.write(request)
        while not self._headers_done:
            await self.wait()
        return Exchange(self, self._parser.get_status_code())

    def take(self) -> bytes:
        """The body bytes received and not yet taken (b"" when none)."""
        if not self._chunks:
            return b""
        chunk = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return chunk

    async def wait(self) -> None:
        """Until more of the answer arrived; raises what ended the connection, or ``TimeoutError``.

        One timer per connection, not one per wait (a stream waits once per read): the timer, when it
        fires, times out a wait that began ``timeout_s`` ago, or sleeps again until the current wait's
        deadline."""
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._loop.create_future()
        self._deadline = self._loop.time() + self._pool.timeout_s
        if self._timer is None:
            self._timer = self._loop.call_at(self._deadline, self._check_deadline)
        try:
            await waiter
        finally:
            self._waiter = None

    def _check_deadline(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # no wait under way: the next one starts the timer again
        if self._loop.time() < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._check_deadline)
        else:
            self._time_out(waiter)

    def release(self) -> None:
        if not self._busy:
            return
        self._busy = False
        if self.complete and self._keep_alive and self._error is None and not self._closed:
            self._chunks.clear()
            self._pool._keep(self)
        else:
            self.abort()

    def abort(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._transport is not None:
            self._transport.close()
        self._pool._forget(self)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _time_out(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(TimeoutError(f"the upstream sent nothing for {self._pool.timeout_s:g} s"))
        self.abort()  # a late answer must not be read as the next exchange's

    def _fail(self, error: TransportError) -> None:
        if self._error is None:
            self._error = error
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(self._error)

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are no asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        if not self._busy:
            self._fail(TransportError("the upstream sent bytes nobody asked for"))
            self.abort()
            return
        self._received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(TransportError(f"the upstream's answer is not valid HTTP/1.1: {exc}"))
            self.abort()

    def eof_received(self) -> bool:
        # A body without Content-Length or chunked encoding ends with the connection.
        if self._headers_done and not self._length_known and not self.complete:
            self.on_message_complete()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._pool._forget(self)
        if self._busy and not self.complete:
            reason = f": {exc}" if exc else ""
            if not self._received:
                self._fail(_Stale(f"the upstream closed the connection before answering{reason}"))
            else:
                self._fail(TransportError(f"the upstream closed the connection mid-answer{reason}"))

    # -- httptools' callbacks --

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self._length_known = True

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self._keep_alive = self._parser.should_keep_alive()  # llhttp forgets it once the message is complete
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()
