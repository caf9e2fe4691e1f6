"""What a dialect is: one API the proxy speaks, on the one call path (``proxy.gateway._forward``).

Every call, whatever its API, takes the same steps in ``Forwarder.handle``: the body parsed
(``json_object``), admitted past the gate, its model resolved to a policy version, keyed (threading
on the chat messages vLLM is sent), the capture flags added, vLLM, the record committed before the
last byte. A ``Dialect`` is what differs, on each side of those steps:

1. ``request(body, served)``: the client's body as the body vLLM is sent at ``upstream`` (bad input
   raises ``proxy.errors.InvalidRequest`` or a subclass: a 4xx in the API's own error shape); ``served``
   says what the model and its vLLM take (``proxy.gateway._served``). Chat and text completions are the
   identity (their body is validated and sent as it is, ``chat/``); the others translate to chat
   completions (``ChatTranslation``: ``responses/``, ``messages/``);
2. ``answer(data, call)``: vLLM's non-streamed answer as the record keeps it and as the client gets it;
   or ``stream(call)``: a ``StreamTranslator`` fed each chunk as it arrives, whose events are sent at
   once (never buffered), and which ends a stream vLLM broke in the API's own failure grammar;
3. every error raised on its routes leaves through ``error(exc)``, in the API's own shape (a prompt
   over the context: ``ContextLengthExceeded``, as each API's clients recognise it).

The record always keeps the client's own body (``calls.request``), the response as the client saw it
(``calls.response``; streams reassembled) and the dialect's name (``calls.endpoint``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import orjson
from starlette.responses import Response

from proxy._limits import check_nesting
from proxy.errors import InvalidRequest, ProxyError, UpstreamError
from proxy.gateway._call import Call
from proxy.gateway._capture import Asked, Endpoint, without_token_fields
from proxy.gateway._served import Served


class StreamTranslator(Protocol):
    """One streamed call's events: vLLM's chunks in, the API's server-sent events out."""

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """One chunk (the fields the client did not ask for already stripped): the SSE events to send now."""
        ...

    def finish(self) -> list[bytes]:
        """After the last chunk, once the record is committed: the closing events."""
        ...

    def failed(self, error: UpstreamError) -> list[bytes]:
        """The upstream broke mid-stream (its error event, ``UpstreamStreamError``; or its connection dropped):
        the API's failure event(s), which end the stream."""
        ...

    def response(self) -> dict[str, Any] | None:
        """The whole response as the client saw it, in the API's non-streamed shape (for the record).

        None where the chunks are the API's own (chat, completions): the record then keeps them as
        the capture reassembled them. After ``failed``: the failed response, as the client saw it.
        """
        ...


class Dialect(Protocol):
    """One API on the call path: its request in, vLLM's answer and stream out, its errors."""

    endpoint: str  # its name, stored in calls.endpoint: "chat.completions", "completions", "responses", "messages"
    upstream: Endpoint  # the vLLM endpoint its calls go to
    asked: Asked | None  # what its client asks of vLLM's answer; None: what the body says (the identity dialects)

    def request(self, body: dict[str, Any], served: Served) -> dict[str, Any]:
        """The client's body as the body vLLM is sent (before the capture flags); ``InvalidRequest`` for bad input."""
        ...

    def answer(self, data: dict[str, Any], call: Call) -> tuple[dict[str, Any], dict[str, Any]]:
        """vLLM's non-streamed answer to ``call``: (the response the record keeps, the response the client gets)."""
        ...

    def stream(self, call: Call) -> StreamTranslator:
        """The events of one streamed call (its body, the name to report: ``call.route.public_name``)."""
        ...

    def error(self, exc: ProxyError, headers: dict[str, str] | None = None) -> Response:
        """``exc`` as this API answers errors: its body shape and status."""
        ...


class ChatTranslation(ABC):
    """An API translated to chat completions and back (Responses, Messages): ``to_chat`` and ``from_chat``.

    Its stream translator reads the usage chunk, and the prompt's ids on vLLM's first chunk (the prompt's
    length, before usage arrives); it builds its own events, so none of vLLM's fields reach the client.
    """

    endpoint: str
    upstream: Endpoint = "chat.completions"
    asked: Asked | None = Asked(token_ids=True, logprobs=False, usage_chunk=True)

    @abstractmethod
    def to_chat(self, body: dict[str, Any], served: Served) -> dict[str, Any]:
        """The client's body as a chat completions body; ``InvalidRequest`` for bad input."""

    @abstractmethod
    def from_chat(self, chat: dict[str, Any], call: Call) -> dict[str, Any]:
        """A non-streamed chat response (token fields stripped) to ``call`` as the API's response."""

    def request(self, body: dict[str, Any], served: Served) -> dict[str, Any]:
        return self.to_chat(body, served)

    def answer(self, data: dict[str, Any], call: Call) -> tuple[dict[str, Any], dict[str, Any]]:
        response = self.from_chat(without_token_fields(data), call)
        return response, response


def usage_detail(usage: dict[str, Any], group: str, name: str) -> int:
    """A count in chat usage's details (``prompt_tokens_details.cached_tokens``, with vLLM's
    ``--enable-prompt-tokens-details``; ``completion_tokens_details.reasoning_tokens``, with a
    ``--reasoning-parser``); 0 where vLLM gives none."""
    details = usage.get(group)
    return int((details.get(name) if isinstance(details, dict) else None) or 0)


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body's JSON object, or the 400 that says what is wrong with it."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON ({exc}).") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    check_nesting(raw, body)
    return body
