"""A streamed call's relay: vLLM's events forwarded as they arrive, the call recorded before the closing event.

What the client is sent is its dialect's (``StreamTranslator``): chat's own chunks, or the events of
the API it speaks. The call's bookkeeping stays its ``Admission``'s (``_admission``): the relay tells it
when the record is written (a stream counts in flight until then) and closes it when the stream ends.

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
from typing import Any

import orjson
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from proxy.errors import UpstreamError, UpstreamStreamError
from proxy.gateway._admission import Admission
from proxy.gateway._call import Call, call_write
from proxy.gateway._capture import StreamCapture
from proxy.gateway.dialects import PASSTHROUGH_EVENTS, StreamTranslator
from proxy.gateway.upstream import SSEDecoder, UpstreamStream
from store import CallWrite


def close_unused(opening: asyncio.Future[tuple[UpstreamStream, Callable[[], None]]]) -> None:
    """A stream opened for a call that failed meanwhile: closed, so vLLM stops generating."""
    if not opening.cancelled() and opening.exception() is None:
        upstream, done = opening.result()
        upstream.close()
        done()


class Relay:
    """One stream in flight: forwards events as they arrive and records the call exactly once.

    ``close()`` runs whatever happened (finished, broken, or the client gone before the
    first byte, when the event generator never even starts): the record is written and
    the upstream response closed.
    """

    def __init__(
        self,
        admission: Admission,
        call: Call,
        upstream: UpstreamStream,
        translator: StreamTranslator = PASSTHROUGH_EVENTS,
    ) -> None:
        self._admission = admission  # the call's counts and record: released by close()
        admission.handed_over = True
        self._translator = translator  # what the client is sent: its dialect's events
        self._call = call
        self._upstream = upstream
        self._assembler = StreamCapture(call.endpoint, call.asked, call.route.public_name)
        self._ttft: float | None = None
        self._recorded = False
        self._done = False  # [DONE] came: the upstream's body ends next
        self.ending = False  # the chunk being yielded is the stream's last (its closing events)

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
            self.ending = True
            yield b"".join(out) + closing  # the events that arrived before the failure first
            return
        self._recorded = True
        response = translator.response()
        try:
            await self._admission.record(
                self._record(200, None, self._assembler.capture.as_response() if response is None else response)
            )
        finally:
            self._admission.recorded()  # before the closing event
        self._done = True
        self.ending = True
        yield b"".join(translator.finish())

    async def _fail(self, error: UpstreamError) -> bytes:
        """Record the call as failed, and return the client's closing events in its API's failure grammar."""
        broken = isinstance(error, UpstreamStreamError)
        self._recorded = True
        closing = b"".join(self._translator.failed(error))  # its response is now a failed one, as recorded
        self._admission.broken(self._call, "upstream_error" if broken else "upstream_closed")
        try:
            await self._admission.record(
                self._record(error.status_code if broken else 502, error.message, self._translator.response())
            )
        finally:
            self._admission.recorded()
        return closing

    async def finish(self) -> None:
        """Once the response is sent: read the end of the upstream's body, so its connection is kept."""
        if self._done:
            await self._upstream.finish()

    def close(self) -> None:
        """However the stream ended: the record (if not yet written), the counts, the upstream connection."""
        if not self._recorded:  # the client went away: keep what was sampled; nobody awaits the commit
            self._recorded = True
            self._admission.record_nowait(self._record(499, "the client disconnected mid-stream"))
        self._upstream.close()
        self._admission.close()

    def _record(self, status: int, error: str | None, response: dict[str, Any] | None = None) -> CallWrite:
        return call_write(self._call, self._assembler.capture, response, status, error, self._ttft)


# The ASGI extension by which ``tracetrain serve``'s HTTP server (``tracetrain_cli._http_server``) tells a stream
# that its client hung up: ``scope["extensions"][HANG_UP]["tell"](callback)`` runs ``callback`` when the
# connection is lost, and returns the function that takes it back.
HANG_UP = "tracetrain.hang_up"


class RelayResponse(StreamingResponse):
    """A streaming response that closes its relay however the response ends.

    Served without Starlette's task group. uvicorn speaks ASGI 2.3, where a client that hangs
    up is told only through ``receive()``; Starlette listens for it with an anyio task group
    per stream, whose set-up came before the first byte and whose tear-down after the last
    (docs/BENCHMARKS.md, issue 14). Here the stream's task is cancelled when the client is gone:
    told by the server itself where it offers the ``HANG_UP`` extension (``tracetrain serve``: no task
    at all), else by one plain task that listens on ``receive()``; under ASGI 2.4 a send to a gone
    client raises ``OSError`` instead.
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
                await self._stream_until_hang_up(scope, receive, send)
            await self._relay.finish()
        finally:
            self._relay.close()

    async def stream_response(self, send: Send) -> None:
        """Starlette's, but the closing events end the body in the same message (one write, not two)."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        relay, more = self._relay, True
        async for chunk in self.body_iterator:
            more = not relay.ending
            await send({"type": "http.response.body", "body": chunk, "more_body": more})
        if more:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stream_until_hang_up(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None
        state = {"hung_up": False, "ended": False}

        def hang_up() -> None:
            if not state["ended"]:  # uvicorn also says "disconnect" once the response is complete
                state["hung_up"] = True
                streaming.cancel()

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            hang_up()

        told = scope.get("extensions", {}).get(HANG_UP)  # by the server, or by a task listening on receive()
        forget = told["tell"](hang_up) if told is not None else asyncio.get_running_loop().create_task(listen()).cancel
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not state["hung_up"] or streaming.uncancel() > 0:
                raise  # cancelled from outside: the server is shutting down
        finally:
            state["ended"] = True
            forget()


def _asgi_version(scope: Scope) -> tuple[int, ...]:
    return tuple(int(part) for part in scope.get("asgi", {}).get("spec_version", "2.0").split("."))
