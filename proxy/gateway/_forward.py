"""Forwarding one OpenAI call to vLLM and recording it.

For every call: parse and validate, resolve the model to a policy version, key the
call to a trajectory and group, forward with capture flags added, strip those from
what the client gets, and record the call. The record is durable before the
response's last byte leaves: non-streamed responses are sent after the commit;
streams hold back only the final ``data: [DONE]`` until the commit.

A lone call (the only one in flight: what latency is measured on) has its store writes
committed on the event loop's thread instead of the writer's (``store._writer``): the
trip to the writer's thread pays off only under load.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from proxy.errors import (
    InvalidRequest,
    ProxyError,
    UpstreamError,
    UpstreamHTTPError,
    error_body,
    from_store_error,
)
from proxy.gateway._capture import (
    Asked,
    Capture,
    Endpoint,
    StreamCapture,
    capture_response,
    prepare_upstream_body,
    strip_response,
    without_token_fields,
)
from proxy.gateway._gate import Gate
from proxy.gateway._keying import Conversation, Key, Keyer, KeyHints
from proxy.gateway._policies import PolicyRegistry, Route
from proxy.gateway._router import Router
from proxy.gateway._sse import SSEDecoder
from proxy.gateway._upstream import Upstream, UpstreamStream
from proxy.gateway._wire import ChatCompletionRequest, CompletionRequest
from proxy.observability._langfuse import LangfuseExporter
from proxy.observability._metrics import Metrics
from store import CallWrite, Store, StoreError

_PATHS: dict[Endpoint, str] = {"chat.completions": "/chat/completions", "completions": "/completions"}
_MODELS: dict[Endpoint, type[BaseModel]] = {"chat.completions": ChatCompletionRequest, "completions": CompletionRequest}
_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class _Call:
    """One call in flight: what it asked, where it goes, whose it is."""

    endpoint: Endpoint
    body: dict[str, Any]
    route: Route
    key: Key
    conversation: Conversation
    asked: Asked
    started_at: float
    t0: float

    def headers(self) -> dict[str, str]:
        return {
            "X-Trajectory-Id": self.key.trajectory_id,
            "X-Group-Id": self.key.group_id,
            "X-Policy-Version": str(self.route.version),
        }


def parse_body(raw: bytes, endpoint: Endpoint) -> dict[str, Any]:
    """The request's JSON, validated against the endpoint's model."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON ({exc}).") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        _MODELS[endpoint].model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest.from_validation(exc.errors()) from exc
    return body


def error_response(exc: ProxyError, headers: dict[str, str] | None = None) -> Response:
    if exc.retry_after_s is not None:
        headers = {**(headers or {}), "Retry-After": str(exc.retry_after_s)}
    return Response(
        orjson.dumps(exc.body()), status_code=exc.status_code, headers=headers, media_type="application/json"
    )


def server_error_response() -> Response:
    """What the client gets for an error the proxy did not expect (its detail goes to the log)."""
    body = error_body("The proxy failed unexpectedly; the error is in its log.", "server_error")
    return Response(orjson.dumps(body), status_code=500, media_type="application/json")


class Forwarder:
    def __init__(
        self,
        upstream: Router | Upstream,
        store: Store,
        keyer: Keyer,
        registry: PolicyRegistry,
        metrics: Metrics,
        langfuse: LangfuseExporter | None = None,
        gate: Gate | None = None,
    ) -> None:
        # Which vLLM server takes each call (one Upstream: always that one).
        self._router = upstream if isinstance(upstream, Router) else Router([upstream])
        # Closed only while a training step has the GPU (--share-gpu); open, passing it costs nothing.
        self._gate = gate if gate is not None else Gate(wait_s=0.0)
        self._store = store
        self._keyer = keyer
        self._registry = registry
        self._metrics = metrics
        self._langfuse = langfuse
        # Calls being handled or streamed: a lone one is written on the event loop's thread (store._writer).
        self._in_flight = 0

    @property
    def _alone(self) -> bool:
        """The call asking is the only one in flight."""
        return self._in_flight == 1

    async def record(self, write: CallWrite) -> None:
        """Commit a call's record (see ``Store.record_call``) and count it."""
        try:
            await self._store.record_call(write, alone=self._alone)
        except StoreError as exc:
            self._metrics.call_not_recorded(write.call)
            raise from_store_error(exc) from exc
        self._metrics.call_recorded(write.call)
        if self._langfuse is not None:
            self._langfuse.call_recorded(write)

    def record_nowait(self, write: CallWrite) -> None:
        self._store.record_call_nowait(write)
        self._metrics.call_recorded(write.call)
        if self._langfuse is not None:
            self._langfuse.call_recorded(write)

    async def handle(self, endpoint: Endpoint, raw: bytes, hints: KeyHints) -> Response:
        started_at, t0 = time.time(), time.perf_counter()
        body = parse_body(raw, endpoint)
        # Held here while a training step has the GPU, and routed after: the new version serves it.
        await self._gate.enter()
        self._in_flight += 1
        try:
            route = await self._route(str(body["model"]))
            messages = body.get("messages") if endpoint == "chat.completions" else None
            conversation = Conversation(route.policy, messages, body.get("prompt"))
            key = await self._resolve(route.policy, hints, conversation)
            upstream_body, asked = prepare_upstream_body(body, endpoint, route.served_model)
            call = _Call(endpoint, body, route, key, conversation, asked, started_at, t0)
            payload = orjson.dumps(upstream_body)
            if body.get("stream"):
                return await self._stream(call, payload)
            return await self._complete(call, payload)
        finally:
            self._in_flight -= 1
            self._gate.leave()  # the upstream answered (a stream: its headers): a hand-over may pause it now

    async def _resolve(self, policy: str, hints: KeyHints, conversation: Conversation) -> Key:
        """The call's key; a lone call's new trajectory is seated later (``Keyer.resolve``'s ``defer_seat``)."""
        try:
            return await self._keyer.resolve(policy, hints, conversation, alone=self._alone, defer_seat=True)
        except StoreError as exc:  # the call cannot be keyed, so it is not answered: a 503 in OpenAI's shape
            raise from_store_error(exc) from exc

    async def _seat(self, call: _Call) -> None:
        try:
            call.key = await self._keyer.seat(call.route.policy, call.key, alone=self._alone)
        except StoreError as exc:
            raise from_store_error(exc) from exc

    async def _route(self, model: str) -> Route:
        if self._registry.base_model is None:
            self._registry.base_model = await self._router.base_model()
        return self._registry.resolve(model)

    async def _complete(self, call: _Call, payload: bytes) -> Response:
        try:
            with self._registry.serving(call.route.version):
                upstream = await self._router.post(call.key.trajectory_id, _PATHS[call.endpoint], payload)
            if upstream.status_code != 200:
                raise UpstreamHTTPError(upstream.status_code, upstream.content)
            data = orjson.loads(upstream.content)
        except ProxyError as exc:
            await self._record_answer(call, _call_write(call, None, None, exc.status_code, exc.message, None))
            return error_response(exc, call.headers())
        capture = capture_response(data, call.endpoint)
        stored = without_token_fields(data)
        await self._record_answer(call, _call_write(call, capture, stored, 200, None, None))
        return Response(
            orjson.dumps(strip_response(data, call.asked, call.route.public_name)),
            headers=call.headers(),
            media_type="application/json",
        )

    async def _record_answer(self, call: _Call, write: CallWrite) -> None:
        """Record a non-streamed call; a seat left to its record gives the call its group (``Keyer.resolve``)."""
        await self.record(write)
        if call.key.seat_in:
            call.key = self._keyer.seated(call.key, write.group_id)

    async def _stream(self, call: _Call, payload: bytes) -> Response:
        opening: Awaitable[tuple[UpstreamStream, Callable[[], None]]]
        opening = self._router.open_stream(call.key.trajectory_id, _PATHS[call.endpoint], payload)
        if call.key.seat_in:
            # A new trajectory's group goes out in the stream's first bytes: it is seated while vLLM
            # starts on the call. One turn of the loop lets the request leave first.
            sending = asyncio.ensure_future(opening)
            await asyncio.sleep(0)
            try:
                await self._seat(call)
            except BaseException:
                sending.add_done_callback(_close_unused)
                raise
            opening = sending
        try:
            upstream, done = await opening
        except ProxyError as exc:
            await self.record(_call_write(call, None, None, exc.status_code, exc.message, None))
            return error_response(exc, call.headers())
        relay = _Relay(self, self._registry, call, upstream, on_close=done)
        return _RelayResponse(relay, headers={**call.headers(), "Cache-Control": "no-cache"})


def _call_write(
    call: _Call,
    capture: Capture | None,
    response: dict[str, Any] | None,
    status: int,
    error: str | None,
    ttft_ms: float | None,
) -> CallWrite:
    first = capture.first if capture else None
    usage = (capture.usage if capture else None) or {}
    tail = None
    if call.key.keyed_by in ("thread", "new") and first is not None and status == 200:
        tail = call.conversation.tail_after(first.message())
    others = (
        [
            {"token_ids": c.token_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
            for i, c in sorted(capture.choices.items())[1:]
        ]
        if capture
        else []
    )
    row = {
        "id": f"call-{uuid.uuid4().hex}",
        "trajectory_id": call.key.trajectory_id,
        "group_id": call.key.group_id,
        "policy": call.route.policy,
        "endpoint": call.endpoint,
        "model": str(call.body.get("model")),
        "served_model": call.route.served_model,
        "version": call.route.version,
        "stream": bool(call.body.get("stream")),
        "request": call.body,
        "response": response,
        "prompt_token_ids": capture.prompt_ids() if capture else [],
        "completion_token_ids": first.token_ids if first else [],
        "logprobs": first.logprobs if first else [],
        "other_choices": others,
        "finish_reason": first.finish_reason if first else None,
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "completion_tokens": int(usage.get("completion_tokens") or 0),
        "status_code": status,
        "error": error,
        "latency_ms": (time.perf_counter() - call.t0) * 1000,
        "ttft_ms": ttft_ms,
        "started_at": call.started_at,
    }
    return CallWrite(
        row,
        call.key.trajectory_id,
        call.key.group_id,
        call.route.policy,
        call.key.keyed_by,
        call.key.task_key,
        tail,
        call.started_at,
        call.route.version,
        call.key.seat_in,
    )


def _close_unused(opening: asyncio.Future[tuple[UpstreamStream, Callable[[], None]]]) -> None:
    """A stream opened for a call that failed meanwhile: closed, so vLLM stops generating."""
    if not opening.cancelled() and opening.exception() is None:
        upstream, done = opening.result()
        upstream.close()
        done()


class _Relay:
    """One stream in flight: forwards events as they arrive and records the call exactly once.

    ``close()`` runs whatever happened (finished, broken, or the client gone before the
    first byte, when the event generator never even starts): the record is written and
    the upstream response closed.
    """

    def __init__(
        self,
        forwarder: Forwarder,
        registry: PolicyRegistry,
        call: _Call,
        upstream: UpstreamStream,
        on_close: Callable[[], None] = lambda: None,
    ) -> None:
        self._forwarder = forwarder
        self._on_close = on_close  # the router's count of the server's calls in flight
        self._registry = registry
        self._call = call
        self._upstream = upstream
        self._assembler = StreamCapture(call.endpoint, call.asked, call.route.public_name)
        self._ttft: float | None = None
        self._recorded = False
        self._done = False  # [DONE] came: the upstream's body ends next
        registry.in_flight[call.route.version] += 1
        forwarder._in_flight += 1
        self._counted = True  # in the forwarder's calls in flight, until its record is written

    async def events(self) -> AsyncIterator[bytes]:
        """Forward each SSE event as it arrives; commit the record before ``[DONE]``."""
        call = self._call
        finished = False
        decoder = SSEDecoder()
        try:
            while not finished and (received := await self._upstream.next_chunk()):
                for event in decoder.feed(received):
                    if self._ttft is None:
                        self._ttft = (time.perf_counter() - call.t0) * 1000
                    if event.data == b"[DONE]":
                        finished = True
                        break
                    chunk = self._assembler.add(orjson.loads(event.data))
                    if chunk is not None:
                        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            if not finished:
                raise UpstreamError("the upstream closed the stream before it finished")
        except (UpstreamError, orjson.JSONDecodeError) as exc:
            message = exc.message if isinstance(exc, ProxyError) else f"the upstream stream broke: {exc!r}"
            self._recorded = True
            try:
                await self._forwarder.record(self._record(502, message))
            finally:
                self._uncount()
            yield b"data: " + orjson.dumps(error_body(message, "upstream_error", None, 502)) + b"\n\n"
            return
        self._recorded = True
        try:
            await self._forwarder.record(self._record(200, None, self._assembler.capture.as_response()))
        finally:
            self._uncount()  # before [DONE]: the client's next call may arrive before close() runs
        self._done = True
        yield _DONE

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self._forwarder._in_flight -= 1

    async def finish(self) -> None:
        """Once the response is sent: read the end of the upstream's body, so its connection is kept."""
        if self._done:
            await self._upstream.finish()

    def close(self) -> None:
        """However the stream ended: the record (if not yet written), the counts, the upstream connection."""
        if not self._recorded:  # the client went away: keep what was sampled; nobody awaits the commit
            self._recorded = True
            self._forwarder.record_nowait(self._record(499, "the client disconnected mid-stream"))
        self._registry.in_flight[self._call.route.version] -= 1
        self._uncount()
        self._upstream.close()
        self._on_close()

    def _record(self, status: int, error: str | None, response: dict[str, Any] | None = None) -> CallWrite:
        return _call_write(self._call, self._assembler.capture, response, status, error, self._ttft)


class _RelayResponse(StreamingResponse):
    """A streaming response that closes its relay however the response ends.

    Served without Starlette's task group. uvicorn speaks ASGI 2.3, where a client that hangs
    up is told only through ``receive()``; Starlette listens for it with an anyio task group
    per stream, whose set-up came before the first byte and whose tear-down after the last
    (docs/BENCHMARKS.md, issue 14). Here one plain task listens and cancels the stream's task
    when the client is gone; under ASGI 2.4 a send to a gone client raises ``OSError`` instead.
    """

    def __init__(self, relay: _Relay, headers: dict[str, str]) -> None:
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
