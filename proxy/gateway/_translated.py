"""The APIs the proxy translates to chat completions (``_dialect``): their calls on the chat path.

A Responses or Messages call is parsed, translated by its dialect, then goes the chat path:
the policy resolved, the call keyed (threading on the translated messages), the capture flags
added, vLLM, the record committed before the last byte. What differs: the record keeps the
client's own body (``calls.request``) and the response as the client saw it in its API
(``calls.response``; streams reassembled by the translator), ``calls.endpoint`` names the API,
and every answer (errors included) is in that API's shape.

The plain chat path does none of this (``Forwarder.handle``): its speed is left as it is.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson
from starlette.responses import Response

from proxy.errors import ProxyError, UpstreamHTTPError
from proxy.gateway._call import Call, call_write
from proxy.gateway._capture import Asked, capture_response, prepare_upstream_body, without_token_fields
from proxy.gateway._dialect import Dialect, StreamTranslator
from proxy.gateway._keying import Conversation, KeyHints
from proxy.gateway._relay import Relay
from proxy.gateway._wire import json_object

if TYPE_CHECKING:
    from proxy.gateway._forward import Forwarder

# What a translated client "asked" of chat: no token fields, and the usage chunk (its translator reads usage).
_ASKED = Asked(token_ids=False, logprobs=False, usage_chunk=True)
_COUNTING = "tracetrain-count-tokens"  # the router's key for token counts: any server tokenizes alike


async def handle(forwarder: Forwarder, dialect: Dialect, raw: bytes, hints: KeyHints) -> Response:
    """One translated call, answered in ``dialect``'s API; ``ProxyError``s before the call is keyed propagate."""
    started_at, t0 = time.time(), time.perf_counter()
    body = json_object(raw)
    chat = dialect.to_chat(body)
    await forwarder._gate.enter()
    forwarder._in_flight += 1
    try:
        route = await forwarder._route(str(chat["model"]))
        conversation = Conversation(route.policy, chat["messages"])
        key = await forwarder._resolve(route.policy, hints, conversation)
        upstream_body, _ = prepare_upstream_body(chat, "chat.completions", route.served_model)
        call = Call("chat.completions", body, route, key, conversation, _ASKED, started_at, t0, dialect.endpoint)
        payload = orjson.dumps(upstream_body)
        if chat.get("stream"):
            translator = dialect.stream(body, route.public_name)
            return await forwarder._stream(call, payload, translator, dialect)
        return await _complete(forwarder, dialect, call, payload)
    finally:
        forwarder._in_flight -= 1
        forwarder._gate.leave()


async def count_tokens(forwarder: Forwarder, chat: dict[str, Any]) -> int:
    """How many tokens vLLM renders ``chat``'s messages (and tools) into, under the model it names."""
    route = await forwarder._route(str(chat["model"]))
    server = forwarder._router.pick(_COUNTING)
    return await server.upstream.count_prompt_tokens({**chat, "model": route.served_model})


async def _complete(forwarder: Forwarder, dialect: Dialect, call: Call, payload: bytes) -> Response:
    try:
        with forwarder._registry.serving(call.route.version):
            upstream = await forwarder._router.post(call.key.trajectory_id, "/chat/completions", payload)
        if upstream.status_code != 200:
            raise UpstreamHTTPError(upstream.status_code, upstream.content)
        data = orjson.loads(upstream.content)
        capture = capture_response(data, "chat.completions")
        response = dialect.from_chat(without_token_fields(data), call.body, call.route.public_name)
    except ProxyError as exc:
        await forwarder._record_answer(call, call_write(call, None, None, exc.status_code, exc.message, None))
        return dialect.error(exc, call.headers())
    await forwarder._record_answer(call, call_write(call, capture, response, 200, None, None))
    return Response(orjson.dumps(response), headers=call.headers(), media_type="application/json")


class TranslatedRelay(Relay):
    """A stream's relay whose events are the translator's: chat chunks in, the API's events out."""

    def __init__(self, forwarder: Forwarder, call: Call, upstream: Any, on_close: Any, translator: StreamTranslator):
        super().__init__(forwarder, forwarder._registry, call, upstream, on_close)
        self._translator = translator

    def _emit(self, chunk: dict[str, Any]) -> bytes:
        return b"".join(self._translator.feed(chunk))

    def _failed(self, message: str) -> tuple[bytes, dict[str, Any] | None]:
        closing = b"".join(self._translator.failed(message))  # the response is now a failed one, as recorded
        return closing, self._translator.response()

    def _response(self) -> dict[str, Any]:
        return self._translator.response()

    def _closing(self) -> bytes:
        return b"".join(self._translator.finish())
