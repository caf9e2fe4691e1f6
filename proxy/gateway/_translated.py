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

import orjson
from starlette.responses import Response

from proxy.errors import ProxyError
from proxy.gateway._call import Call, call_write
from proxy.gateway._capture import Asked, capture_response, prepare_upstream_body, without_token_fields
from proxy.gateway._forward import Forwarder
from proxy.gateway._keying import Conversation, KeyHints
from proxy.gateway._wire import json_object
from proxy.gateway.dialects import Dialect

# What a translated client "asked" of chat: no token fields, and the usage chunk (its translator reads usage).
_ASKED = Asked(token_ids=False, logprobs=False, usage_chunk=True)


async def handle(forwarder: Forwarder, dialect: Dialect, raw: bytes, hints: KeyHints) -> Response:
    """One translated call, answered in ``dialect``'s API; ``ProxyError``s before the call is keyed propagate."""
    started_at, t0 = time.time(), time.perf_counter()
    body = json_object(raw)
    chat = dialect.to_chat(body)
    await forwarder.admit()
    try:
        route = await forwarder.route(str(chat["model"]))
        conversation = Conversation(route.policy, chat["messages"])
        key = await forwarder.key(route.policy, hints, conversation)
        upstream_body, _ = prepare_upstream_body(chat, "chat.completions", route.served_model)
        call = Call("chat.completions", body, route, key, conversation, _ASKED, started_at, t0, dialect.endpoint)
        payload = orjson.dumps(upstream_body)
        if chat.get("stream"):
            translator = dialect.stream(body, route.public_name)
            return await forwarder.stream(call, payload, translator, dialect)
        return await _complete(forwarder, dialect, call, payload)
    finally:
        forwarder.release()


async def _complete(forwarder: Forwarder, dialect: Dialect, call: Call, payload: bytes) -> Response:
    try:
        data = await forwarder.ask(call, "/chat/completions", payload)
        capture = capture_response(data, "chat.completions")
        response = dialect.from_chat(without_token_fields(data), call.body, call.route.public_name)
    except ProxyError as exc:
        await forwarder.record_answer(call, call_write(call, None, None, exc.status_code, exc.message, None))
        return dialect.error(exc, call.headers())
    await forwarder.record_answer(call, call_write(call, capture, response, 200, None, None))
    return Response(orjson.dumps(response), headers=call.headers(), media_type="application/json")
