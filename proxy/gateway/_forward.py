"""The one call path: every call, in any API the proxy speaks, forwarded to vLLM and recorded.

``Forwarder.handle(dialect, raw, hints)`` takes each call through the same steps: parse and
validate its body (its dialect's ``request``: the identity for chat and text completions, a
translation to chat for the Responses and Messages APIs), admit it past the gate, resolve its model
to a policy version, key it to a trajectory and group (threading on the messages vLLM is sent; while
a canary trial runs, the trajectory's version is its share of the trial's: ``_split``),
forward it with the capture flags added, answer (whole, or relayed as its stream arrives, in its
dialect's shape), and record it. The record is durable before the response's last byte leaves:
non-streamed responses are sent after the commit; streams hold back only their closing event
until the commit (their relay: ``_relay``). What a dialect is: ``proxy.gateway.dialects``.

A lone call (the only one in flight: what latency is measured on) has its store writes
committed on the event loop's thread instead of the writer's (``store._writer``): the
trip to the writer's thread pays off only under load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.responses import Response

from proxy._policy_config import SamplingDefaults
from proxy._policy_keys import EVERY, Scope
from proxy.errors import ProxyError, store_errors
from proxy.gateway._admission import Admission, Calls
from proxy.gateway._call import Call, call_write
from proxy.gateway._capture import Endpoint, capture_response, constrain, prepare_upstream_body
from proxy.gateway._gate import Gate
from proxy.gateway._keying import Conversation, Key, Keyer, KeyHints, new_trajectory_id
from proxy.gateway._policies import PolicyRegistry, Route
from proxy.gateway._relay import Relay, RelayResponse, close_unused
from proxy.gateway._served import Served
from proxy.gateway.dialects import DIALECTS, Dialect, DialectName, count_tokens_chat, json_object
from proxy.gateway.upstream import Router, Upstream, UpstreamStream, upstream_http_error
from proxy.observability._exporters import Exporters
from proxy.observability._metrics import Metrics
from store import CallWrite, Store, StoreFull

_PATHS: dict[Endpoint, str] = {"chat.completions": "/chat/completions", "completions": "/completions"}
_COUNTING = "tracetrain-count-tokens"  # the router's key for token counts: any server tokenizes alike
# Where each API asks for its longest answer, the name a policy's default goes under first (Messages requires one).
_MAX_TOKENS: dict[DialectName, tuple[str, ...]] = {
    "chat.completions": ("max_tokens", "max_completion_tokens"), "completions": ("max_tokens",),
    "responses": ("max_output_tokens",), "messages": (),
}  # fmt: skip


def with_sampling_defaults(dialect: DialectName, body: dict[str, Any], defaults: SamplingDefaults) -> None:
    """The policy's sampling defaults, in ``body`` where the client did not say: in the API's own names, so the
    record shows what sampled the call (the trainer reads its temperature there)."""
    for name, value in (("temperature", defaults.temperature), ("top_p", defaults.top_p)):
        if value is not None and body.get(name) is None:
            body[name] = value
    fields = _MAX_TOKENS[dialect]
    if defaults.max_tokens is not None and fields and all(body.get(name) is None for name in fields):
        body[fields[0]] = defaults.max_tokens


class Forwarder:
    """The call path of every API (``handle``), and the record of each call; one per app."""

    def __init__(
        self,
        upstream: Router | Upstream,
        store: Store,
        keyer: Keyer,
        registry: PolicyRegistry,
        metrics: Metrics,
        exporters: Exporters | None = None,
        gate: Gate | None = None,
        served: Served | None = None,
    ) -> None:
        # Which vLLM server takes each call (one Upstream: always that one).
        self._router = upstream if isinstance(upstream, Router) else Router([upstream])
        self._calls = Calls(store, keyer, registry, metrics, exporters, gate)  # each call's counts and record
        self._store = store
        self._keyer = keyer
        self._registry = registry
        self._served = served if served is not None else Served()  # what the model and its vLLM take

    async def handle(self, dialect: DialectName, raw: bytes, hints: KeyHints, scope: Scope = EVERY) -> Response:
        """One call in ``dialect``'s API, answered in that API's shape once it is recorded (see the module's
        docstring). A ``ProxyError`` raised before the call goes to vLLM (bad input, an unknown model or one
        outside the key's ``scope``, a store that cannot key it) propagates, unrecorded: its caller answers it
        (``Dialect.error``)."""
        started_at, t0 = time.time(), time.perf_counter()
        api = DIALECTS[dialect]
        body = json_object(raw)
        if isinstance(model := body.get("model"), str):  # else the dialect's check below says what is wrong
            with_sampling_defaults(dialect, body, self._registry.policy(model, scope).settings.sampling)
        sent = api.request(body, self._served)
        admission = await self._calls.admit()
        try:
            route = await self._route(str(sent["model"]), scope)
            messages = sent.get("messages") if api.upstream == "chat.completions" else None
            conversation = Conversation(route.policy, messages, sent.get("prompt"))
            key = await self._key(route.policy, hints, conversation)
            route = self._registry.for_trajectory(route, key.trajectory_id, key.served_by)  # a canary trial's split
            admission.serving(route)
            self._keyer.served(key.trajectory_id, route.version)
            upstream_body, asked = prepare_upstream_body(sent, api.upstream, route.served_model)
            if api.asked is not None:
                asked = api.asked
            call = Call(
                api.upstream,
                body,
                route,
                key,
                conversation,
                asked,
                started_at,
                t0,
                api.endpoint,
                self._served,
                structured_outputs=constrain(upstream_body) if api.upstream == "chat.completions" else None,
            )
            payload = orjson.dumps(upstream_body)
            if sent.get("stream"):
                return await self._stream(api, call, payload, admission)
            return await self._complete(api, call, payload, admission)
        finally:
            admission.answered()  # a hand-over may pause vLLM now
            if not admission.handed_over:  # a relay releases a stream's once its stream ends
                admission.close()

    async def _route(self, model: str, scope: Scope) -> Route:
        """The policy version that serves ``model`` (a 404 outside ``scope``)."""
        if self._registry.base_model is None:
            self._registry.base_model = await self._router.base_model()
        return self._registry.resolve(model, scope)

    async def count_tokens(self, raw: bytes, scope: Scope = EVERY) -> int:
        """How many tokens vLLM renders a ``/v1/messages/count_tokens`` body into (its messages and tools, as a
        call would send them), under the model it names (a 404 outside ``scope``)."""
        chat = count_tokens_chat(json_object(raw), self._served)
        route = await self._route(str(chat["model"]), scope)
        server = self._router.pick(_COUNTING)
        return await server.upstream.count_prompt_tokens({**chat, "model": route.served_model})

    async def _key(self, policy: str, hints: KeyHints, conversation: Conversation) -> Key:
        """The call's key; on SQLite a new trajectory is seated later (``Keyer.resolve``'s ``defer_seat``)."""
        size = self._registry.get(policy).settings.group_size if policy in self._registry else None
        with store_errors():  # the call cannot be keyed, so it is not answered: a 503 in OpenAI's shape
            try:
                return await self._keyer.resolve(policy, hints, conversation, alone=self._calls.alone, defer_seat=True,
                                                 group_size=size)  # fmt: skip
            except StoreFull:  # no seat can be written: the call is served, unrecorded (``record``)
                trajectory_id = hints.header_trajectory or hints.path_trajectory or new_trajectory_id()
                return Key(trajectory_id, hints.header_group or hints.path_group or "", "new", None)

    async def _seat(self, call: Call) -> None:
        with store_errors():
            try:
                call.key = await self._keyer.seat(call.route.policy, call.key, alone=self._calls.alone)
            except StoreFull:
                call.key = dataclasses.replace(call.key, seat_in=0)  # served unseated; its record will fail too

    async def _ask(self, call: Call, payload: bytes) -> dict[str, Any]:
        """vLLM's answer to a call that does not stream, parsed; an error status raises (``upstream_http_error``)."""
        upstream = await self._router.post(call.key.trajectory_id, _PATHS[call.endpoint], payload)
        if upstream.status_code != 200:
            raise upstream_http_error(upstream.status_code, upstream.content)
        data: dict[str, Any] = orjson.loads(upstream.content)
        return data

    async def _complete(self, dialect: Dialect, call: Call, payload: bytes, admission: Admission) -> Response:
        try:
            data = await self._ask(call, payload)
        except ProxyError as exc:
            write = call_write(call, None, None, exc.status_code, exc.message, None)
            await self._record_answer(call, write, admission)
            return dialect.error(exc, call.headers())
        capture = capture_response(data, call.endpoint)
        recorded, sent = dialect.answer(data, call)
        await self._record_answer(call, call_write(call, capture, recorded, 200, None, None), admission)
        return Response(orjson.dumps(sent), headers=call.headers(), media_type="application/json")

    async def _record_answer(self, call: Call, write: CallWrite, admission: Admission) -> None:
        """Record a non-streamed call; a seat left to its record gives the call its group (``Keyer.resolve``)."""
        if await admission.record(write) and call.key.seat_in:
            call.key = self._keyer.seated(call.key, write.group_id, call.route.policy)

    async def _stream(self, dialect: Dialect, call: Call, payload: bytes, admission: Admission) -> Response:
        """Open vLLM's stream for ``call`` and relay it in ``dialect``'s events."""
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
            await admission.record(call_write(call, None, None, exc.status_code, exc.message, None))
            return dialect.error(exc, call.headers())
        admission.opened(done)
        relay = Relay(admission, call, upstream, translator=dialect.stream(call))
        return RelayResponse(relay, headers={**call.headers(), "Cache-Control": "no-cache"})
