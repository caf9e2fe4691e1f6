"""The contract between the chat path and each API the proxy translates to it (Responses, Messages).

A call on ``/v1/responses`` or ``/v1/messages`` is turned into a chat completion for vLLM and
its answer turned back (docs/ARCHITECTURE.md, "Every API on the chat path"): the chat path
already captures exact prompt ids, sampled ids and a logprob per sampled token, relays streams,
keys, threads and records. A ``Dialect`` is the translation of one API, both ways:

1. ``to_chat(body)``: the client's validated body as a chat completions body (bad input raises
   ``proxy.errors.InvalidRequest`` or a subclass: a 4xx in the API's own error shape);
2. the chat path runs: policy resolution, keying and threading on the translated messages,
   capture flags, vLLM, the record (``request`` = the client's own body, ``response`` = the
   translated response as the client saw it, ``endpoint`` = ``Dialect.endpoint``);
3. ``from_chat(chat, body, model)``: the non-streamed chat response (token fields already
   stripped) as the API's response; or ``stream(body, model)``: a ``StreamTranslator`` fed each
   chat chunk as it arrives, whose events are sent at once (never buffered);
4. every error raised on these routes leaves through ``error(exc)``, in the API's own shape.
"""

from __future__ import annotations

from typing import Any, Protocol

from starlette.responses import Response

from proxy.errors import ProxyError


class StreamTranslator(Protocol):
    """One streamed call's translation: chat chunks in, the API's server-sent events out."""

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """One ``chat.completion.chunk`` (token fields already stripped): the SSE events to send now."""
        ...

    def finish(self) -> list[bytes]:
        """After the last chunk, once the record is committed: the closing events."""
        ...

    def failed(self, message: str) -> list[bytes]:
        """The upstream broke mid-stream: the API's error event(s)."""
        ...

    def response(self) -> dict[str, Any]:
        """The whole response as the client saw it, in the API's non-streamed shape (for the record)."""
        ...


class Dialect(Protocol):
    """One API translated to and from chat completions."""

    endpoint: str  # "responses" | "messages": stored in calls.endpoint

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The client's body as a chat completions body; ``InvalidRequest`` for bad input."""
        ...

    def from_chat(self, chat: dict[str, Any], body: dict[str, Any], model: str) -> dict[str, Any]:
        """A non-streamed chat response (token fields stripped) as the API's response; ``model``: the name to report."""
        ...

    def stream(self, body: dict[str, Any], model: str) -> StreamTranslator:
        """A translator for one streamed call of ``body``."""
        ...

    def error(self, exc: ProxyError, headers: dict[str, str] | None = None) -> Response:
        """``exc`` as this API answers errors: its body shape and status."""
        ...
