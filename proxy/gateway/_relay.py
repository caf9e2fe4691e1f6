"""A streamed call's relay: vLLM's events forwarded as they arrive, the call recorded before the closing event.

What the client is sent is its dialect's (``StreamTranslator``): chat's own chunks, or the events of
the API it speaks. The relay knows the forwarder only as a ``Recorder``: the record itself, and the
count of calls in flight, which a stream is part of until its record is written (a lone call's
record is committed on the event loop's thread, ``store._writer``).

A stream vLLM breaks is a failed call, never a whole one: vLLM 0.32 reports an engine failure inside a
stream as ``data: {"error": {...}}`` then ``data: [DONE]`` (``UpstreamStreamError``), and a connection
may drop before ``[DONE]``. Either way the client's stream ends in its API's failure grammar
(``StreamTranslator.failed``) and the record says so: the error's status (vLLM's code; 502 for a dropped
connection) and its message, so that the trainer, the judge, export and SFT leave it out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import orjson
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from proxy.errors import UpstreamError, UpstreamStreamError
from proxy.gateway._call import Call, call_write
from proxy.gateway._capture import StreamCapture
from proxy.gateway._policies import PolicyRegistry
from proxy.gateway.dialects import PASSTHROUGH_EVENTS, StreamTranslator
from proxy.gateway.upstream import SSEDecoder, UpstreamStream
from store import CallWrite


def close_unused(opening: asyncio.Future[tuple[UpstreamStream, Callable[[], None]]]) -> None:
    """A stream opened for a call that failed meanwhile: closed, so vLLM stops generating."""
    if not opening.cancelled() and opening.exception() is None:
        upstream, done = opening.result()
        upstream.close()
        done()


class Recorder(Protocol):
    """What a relay needs of the forwarder (``proxy.gateway._forward.Forwarder`` is one)."""

    async def record(self, write: CallWrite) -> bool: ...

    def record_nowait(self, write: CallWrite) -> None: ...

    def streaming(self) -> None:
        """A stream starts: one more call in flight, until ``streamed``."""
        ...

    def streamed(self) -> None:
        """The stream's record is written (or handed to the writer): one call less in flight."""
        ...

    def stream_broken(self, call: Call, reason: str) -> None:
        """vLLM broke ``call``'s stream: ``reason`` is "upstream_error" (its error event) or "upstream_closed"."""
        ...


class Relay:
    """One stream in flight: forwards events as they arrive and records the call exactly once.

    ``close()`` runs whatever happened (finished, broken, or the client gone before the
    first byte, when the event generator never even starts): the record is written and
    the upstream response closed.
    """

    def __init__(
        self,
        forwarder: Recorder,
        registry: PolicyRegistry,
        call: Call,
        upstream: UpstreamStream,
        on_close: Callable[[], None] = lambda: None,
        translator: StreamTranslator = PASSTHROUGH_EVENTS,
    ) -> None:
        self._forwarder = forwarder
        self._on_close = on_close  # the router's count of the server's calls in flight
        self._translator = translator  # what the client is sent: its dialect's events
        self._registry = registry
        self._call = call
        self._upstream = upstream
        self._assembler = StreamCapture(call.endpoint, call.asked, call.route.public_name)
        self._ttft: float | None = None
        self._recorded = False
        self._done = False  # [DONE] came: the upstream's body ends next
        registry.in_flight[(call.route.policy, call.route.version)] += 1
        forwarder.streaming()
        self._counted = True  # in the forwarder's calls in flight, until its record is written

    async def events(self) -> AsyncIterator[bytes]:
        """Forward each SSE event as it arrives; commit the record before the closing event (chat: ``[DONE]``)."""
        call = self._call
        translator = self._translator
        feed = translator.feed  # looked up once: the loop below runs per chunk
        finished = False
        decoder = SSEDecoder()
        out: list[bytes] = []  # the client's events for what one read of the upstream brought
        try:
            while not finished and (received := await self._upstream.next_chunk()):
                for event in decoder.feed(received):
                    if self._ttft is None:
                        self._ttft = (time.perf_counter() - call.t0) * 1000
                    if event.data == b"[DONE]":
                        finished = True
                        break
                    data = orjson.loads(event.data)
                    if "error" in data and not data.get("choices"):  # vLLM's failure event; [DONE] follows
                        raise UpstreamStreamError.from_event(event.data, data["error"])
                    chunk = self._assembler.add(data)
                    if chunk is not None:
                        out += feed(chunk)
                if out:
                    # Events that arrived together leave together: one write to the client per read
                    # of vLLM, not one per event (each write is a system call in the server).
                    yield b"".join(out)
                    out = []
            if not finished:
                raise UpstreamError("the upstream closed the stream before it finished")
        except (UpstreamError, orjson.JSONDecodeError) as exc:
            closing = await self._fail(exc if isinstance(exc, UpstreamError) else UpstreamError(
                f"the upstream stream broke: {exc!r}"))  # fmt: skip
            yield b"".join(out) + closing  # the events that arrived before the failure first
            return
        self._recorded = True
        response = translator.response()
        try:
            await self._forwarder.record(
                self._record(200, None, self._assembler.capture.as_response() if response is None else response)
            )
        finally:
            self._uncount()  # before the closing event: the client's next call may arrive before close() runs
        self._done = True
        yield b"".join(translator.finish())

    async def _fail(self, error: UpstreamError) -> bytes:
        """Record the call as failed, and return the client's closing events in its API's failure grammar."""
        broken = isinstance(error, UpstreamStreamError)
        self._recorded = True
        closing = b"".join(self._translator.failed(error))  # its response is now a failed one, as recorded
        self._forwarder.stream_broken(self._call, "upstream_error" if broken else "upstream_closed")
        try:
            await self._forwarder.record(
                self._record(error.status_code if broken else 502, error.message, self._translator.response())
            )
        finally:
            self._uncount()
        return closing

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self._forwarder.streamed()

    async def finish(self) -> None:
        """Once the response is sent: read the end of the upstream's body, so its connection is kept."""
        if self._done:
            await self._upstream.finish()

    def close(self) -> None:
        """However the stream ended: the record (if not yet written), the counts, the upstream connection."""
        if not self._recorded:  # the client went away: keep what was sampled; nobody awaits the commit
            self._recorded = True
            self._forwarder.record_nowait(self._record(499, "the client disconnected mid-stream"))
        self._registry.in_flight[(self._call.route.policy, self._call.route.version)] -= 1
        self._uncount()
        self._upstream.close()
        self._on_close()

    def _record(self, status: int, error: str | None, response: dict[str, Any] | None = None) -> CallWrite:
        return call_write(self._call, self._assembler.capture, response, status, error, self._ttft)


class RelayResponse(StreamingResponse):
    """A streaming response that closes its relay however the response ends.

    Served without Starlette's task group. uvicorn speaks ASGI 2.3, where a client that hangs
    up is told only through ``receive()``; Starlette listens for it with an anyio task group
    per stream, whose set-up came before the first byte and whose tear-down after the last
    (docs/BENCHMARKS.md, issue 14). Here one plain task listens and cancels the stream's task
    when the client is gone; under ASGI 2.4 a send to a gone client raises ``OSError`` instead.
    """

    def __init__(self, relay: Relay, headers: dict[str, str]) -> None:
        super().__init__(relay.events(), media_type="text/event-stream", headers=headers)
        self._relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if _asgi_version(scope) >= (2, 4):
                try:
                    await self.stream_response(send)
                except OSError as exc:
                    raise ClientDisconnect() from exc
            else:
                await self._stream_until_hang_up(receive, send)
            await self._relay.finish()
        finally:
            self._relay.close()

    async def _stream_until_hang_up(self, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None
        state = {"hung_up": False, "ended": False}

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not state["ended"]:  # uvicorn also says "disconnect" once the response is complete
                state["hung_up"] = True
                streaming.cancel()

        listener = asyncio.get_running_loop().create_task(listen())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not state["hung_up"] or streaming.uncancel() > 0:
                raise  # cancelled from outside: the server is shutting down
        finally:
            state["ended"] = True
            listener.cancel()


def _asgi_version(scope: Scope) -> tuple[int, ...]:
    return tuple(int(part) for part in scope.get("asgi", {}).get("spec_version", "2.0").split("."))
