"""Chat completions and (legacy) text completions: the identity dialects (``CHAT``, ``COMPLETIONS``).

vLLM speaks these APIs itself, so nothing is translated: the body is validated (``_wire``) and sent as
the client wrote it, plus the capture flags; the answer goes back as vLLM wrote it, less what the
client did not ask for (``proxy.gateway._capture.strip_response``), and a stream's chunks are relayed as
they come (``PASSTHROUGH_EVENTS``). Errors have OpenAI's shape; a prompt over the context is OpenAI's
``context_length_exceeded`` on its ``messages`` (chat) or ``prompt`` (completions). A stream vLLM broke
ends as vLLM ends it: its error event (``data: {"error": {...}}``, as vLLM sent it; for a dropped
connection one in the same shape), then ``data: [DONE]``: the openai SDK raises ``APIError`` on it.
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from proxy.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    ProxyError,
    UpstreamError,
    UpstreamStreamError,
    error_response,
)
from proxy.gateway._call import Call
from proxy.gateway._capture import Asked, Endpoint, strip_response, without_token_fields
from proxy.gateway._served import Served
from proxy.gateway.dialects.chat._wire import ChatCompletionRequest, CompletionRequest

_DONE = b"data: [DONE]\n\n"


class PassthroughEvents:
    """A stream in its own API's events: each chunk as a ``data:`` event, then ``[DONE]`` (a ``StreamTranslator``)."""

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        return [b"data: " + orjson.dumps(chunk) + b"\n\n"]

    def finish(self) -> list[bytes]:
        return [_DONE]

    def failed(self, error: UpstreamError) -> list[bytes]:
        if isinstance(error, UpstreamStreamError) and error.event is not None:
            event = error.event  # vLLM's own error event, as it sent it
        else:  # the connection dropped: an event in vLLM's shape (its ErrorResponse: the code is the status)
            body = {"error": {"message": error.message, "type": "BadGatewayError", "param": None, "code": 502}}
            event = orjson.dumps(body)
        return [b"data: " + event + b"\n\n", _DONE]

    def response(self) -> None:
        return None  # the record keeps the chunks as the capture reassembled them


PASSTHROUGH_EVENTS = PassthroughEvents()  # it holds no state: one for every stream


class Passthrough:
    """An API vLLM serves itself (a ``Dialect`` that translates nothing)."""

    asked: Asked | None = None  # what the client's own body asks for

    def __init__(self, endpoint: Endpoint, model: type[BaseModel], prompt_param: str) -> None:
        self.endpoint: str = endpoint
        self.upstream: Endpoint = endpoint
        self._model = model
        self._prompt_param = prompt_param  # what a context_length_exceeded error names, as OpenAI does

    def request(self, body: dict[str, Any], served: Served) -> dict[str, Any]:
        try:
            self._model.model_validate(body)
        except ValidationError as exc:
            raise InvalidRequest.from_validation(exc.errors()) from exc
        return body

    def answer(self, data: dict[str, Any], call: Call) -> tuple[dict[str, Any], dict[str, Any]]:
        recorded = without_token_fields(data)  # a copy: what follows strips ``data`` in place
        return recorded, strip_response(data, call.asked, call.route.public_name)

    def stream(self, call: Call) -> PassthroughEvents:
        return PASSTHROUGH_EVENTS

    def error(self, exc: ProxyError, headers: dict[str, str] | None = None) -> Response:
        if isinstance(exc, ContextLengthExceeded):
            exc = exc.with_param(self._prompt_param)
        return error_response(exc, headers)


CHAT = Passthrough("chat.completions", ChatCompletionRequest, "messages")
COMPLETIONS = Passthrough("completions", CompletionRequest, "prompt")
