"""Forwarding one OpenAI call to vLLM and recording it.

For every call: parse and validate, resolve the model to a policy version, key the
call to a trajectory and group, forward with capture flags added, strip those from
what the client gets, and record the call. The record is durable before the
response's last byte leaves: non-streamed responses are sent after the commit;
streams hold back only the final ``data: [DONE]`` until the commit (their relay: ``_relay``).

A lone call (the only one in flight: what latency is measured on) has its store writes
committed on the event loop's thread instead of the writer's (``store._writer``): the
trip to the writer's thread pays off only under load.

The APIs translated to chat (``_translated``) go the same way through the public methods
below (``admit``, ``route``, ``key``, ``ask``, ``stream``); the forwarder knows nothing of them
but the stream translator it hands to their relay.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from proxy.errors import InvalidRequest, ProxyError, UpstreamHTTPError, error_response, store_errors
from proxy.gateway._call import Call, call_write
from proxy.gateway._capture import (
    Endpoint,
    capture_response,
    prepare_upstream_body,
    strip_response,
    without_token_fields,
)
from proxy.gateway._dialect import Dialect, StreamTranslator
from proxy.gateway._gate import Gate
from proxy.gateway._keying import Conversation, Key, Keyer, KeyHints, new_trajectory_id
from proxy.gateway._policies import PolicyRegistry, Route
from proxy.gateway._relay import Relay, RelayResponse, TranslatedRelay, close_unused
from proxy.gateway._router import Router
from proxy.gateway._upstream import Upstream, UpstreamStream
from proxy.gateway._wire import ChatCompletionRequest, CompletionRequest, json_object
from proxy.observability._exporters import Exporters
from proxy.observability._metrics import Metrics
from store import CallWrite, Store, StoreError, StoreFull

_PATHS: dict[Endpoint, str] = {"chat.completions": "/chat/completions", "completions": "/completions"}
_MODELS: dict[Endpoint, type[BaseModel]] = {"chat.completions": ChatCompletionRequest, "completions": CompletionRequest}
_COUNTING = "tracetrain-count-tokens"  # the router's key for token counts: any server tokenizes alike


def parse_body(raw: bytes, endpoint: Endpoint) -> dict[str, Any]:
    """The request's JSON, validated against the endpoint's model."""
    body = json_object(raw)
    try:
        _MODELS[endpoint].model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest.from_validation(exc.errors()) from exc
    return body


class Forwarder:
    def __init__(
        self,
        upstream: Router | Upstream,
        store: Store,
        keyer: Keyer,
        registry: PolicyRegistry,
        metrics: Metrics,
        exporters: Exporters | None = None,
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
        self._exporters = exporters  # OTLP and Langfuse: each record queued for them, never awaited
        # Calls being handled or streamed: a lone one is written on the event loop's thread (store._writer).
        self._in_flight = 0

    @property
    def _alone(self) -> bool:
        """The call asking is the only one in flight."""
        return self._in_flight == 1

    async def record(self, write: CallWrite) -> bool:
        """Commit a call's record (see ``Store.record_call``) and count it; False when the store's disk is full.

        A full disk stops capture, not serving: the call is answered and counted unrecorded
        (``tracetrain_capture_failures{reason="disk_full"}``); capture resumes once space is freed.
        Any other store failure is a 503: the store may be back in a moment, and the client retries.
        """
        with store_errors():
            try:
                await self._store.record_call(write, alone=self._alone)
            except StoreFull:
                self._metrics.call_unrecorded(write.call)
                return False
            except StoreError:
                self._metrics.call_not_recorded(write.call)
                raise
        self._metrics.call_recorded(write.call)
        if self._exporters is not None:
            self._exporters.call_recorded(write)
        return True

    def record_nowait(self, write: CallWrite) -> None:
        self._store.record_call_nowait(write)
        self._metrics.call_recorded(write.call)
        if self._exporters is not None:
            self._exporters.call_recorded(write)

    async def handle(self, endpoint: Endpoint, raw: bytes, hints: KeyHints) -> Response:
        started_at, t0 = time.time(), time.perf_counter()
        body = parse_body(raw, endpoint)
        await self.admit()
        try:
            route = await self.route(str(body["model"]))
            messages = body.get("messages") if endpoint == "chat.completions" else None
            conversation = Conversation(route.policy, messages, body.get("prompt"))
            key = await self.key(route.policy, hints, conversation)
            upstream_body, asked = prepare_upstream_body(body, endpoint, route.served_model)
            call = Call(endpoint, body, route, key, conversation, asked, started_at, t0)
            payload = orjson.dumps(upstream_body)
            if body.get("stream"):
                return await self.stream(call, payload)
            return await self._complete(call, payload)
        finally:
            self.release()

    async def admit(self) -> None:
        """Let a call in: held here while a training step has the GPU, and routed after (the new version
        serves it); counted in flight until ``release``."""
        await self._gate.enter()
        self._in_flight += 1

    def release(self) -> None:
        """The upstream answered (a stream: its headers): a hand-over may pause it now."""
        self._in_flight -= 1
        self._gate.leave()

    async def route(self, model: str) -> Route:
        """The policy version that serves ``model``."""
        if self._registry.base_model is None:
            self._registry.base_model = await self._router.base_model()
        return self._registry.resolve(model)

    async def count_tokens(self, chat: dict[str, Any]) -> int:
        """How many tokens vLLM renders ``chat``'s messages (and tools) into, under the model it names."""
        route = await self.route(str(chat["model"]))
        server = self._router.pick(_COUNTING)
        return await server.upstream.count_prompt_tokens({**chat, "model": route.served_model})

    async def key(self, policy: str, hints: KeyHints, conversation: Conversation) -> Key:
        """The call's key; a lone call's new trajectory is seated later (``Keyer.resolve``'s ``defer_seat``)."""
        with store_errors():  # the call cannot be keyed, so it is not answered: a 503 in OpenAI's shape
            try:
                return await self._keyer.resolve(policy, hints, conversation, alone=self._alone, defer_seat=True)
            except StoreFull:  # no seat can be written: the call is served, unrecorded (``record``)
                trajectory_id = hints.header_trajectory or hints.path_trajectory or new_trajectory_id()
                return Key(trajectory_id, hints.header_group or hints.path_group or "", "new", None)

    async def _seat(self, call: Call) -> None:
        with store_errors():
            try:
                call.key = await self._keyer.seat(call.route.policy, call.key, alone=self._alone)
            except StoreFull:
                call.key = dataclasses.replace(call.key, seat_in=0)  # served unseated; its record will fail too

    async def ask(self, call: Call, path: str, payload: bytes) -> dict[str, Any]:
        """vLLM's answer to a call that does not stream, parsed; an error status is an ``UpstreamHTTPError``."""
        with self._registry.serving(call.route.version):
            upstream = await self._router.post(call.key.trajectory_id, path, payload)
        if upstream.status_code != 200:
            raise UpstreamHTTPError(upstream.status_code, upstream.content)
        data: dict[str, Any] = orjson.loads(upstream.content)
        return data

    async def _complete(self, call: Call, payload: bytes) -> Response:
        try:
            data = await self.ask(call, _PATHS[call.endpoint], payload)
        except ProxyError as exc:
            await self.record_answer(call, call_write(call, None, None, exc.status_code, exc.message, None))
            return error_response(exc, call.headers())
        capture = capture_response(data, call.endpoint)
        stored = without_token_fields(data)
        await self.record_answer(call, call_write(call, capture, stored, 200, None, None))
        return Response(
            orjson.dumps(strip_response(data, call.asked, call.route.public_name)),
            headers=call.headers(),
            media_type="application/json",
        )

    async def record_answer(self, call: Call, write: CallWrite) -> None:
        """Record a non-streamed call; a seat left to its record gives the call its group (``Keyer.resolve``)."""
        if await self.record(write) and call.key.seat_in:
            call.key = self._keyer.seated(call.key, write.group_id)

    async def stream(
        self, call: Call, payload: bytes, translator: StreamTranslator | None = None, dialect: Dialect | None = None
    ) -> Response:
        """Open vLLM's stream for ``call`` and relay it (through ``translator``: in a translated API's events)."""
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
                sending.add_done_callback(close_unused)
                raise
            opening = sending
        try:
            upstream, done = await opening
        except ProxyError as exc:
            await self.record(call_write(call, None, None, exc.status_code, exc.message, None))
            return (dialect.error if dialect is not None else error_response)(exc, call.headers())
        relay = (
            Relay(self, self._registry, call, upstream, on_close=done)
            if translator is None
            else TranslatedRelay(self, self._registry, call, upstream, done, translator)
        )
        return RelayResponse(relay, headers={**call.headers(), "Cache-Control": "no-cache"})
