"""Chat completions and (legacy) text completions: the identity dialects (``CHAT``, ``COMPLETIONS``).

vLLM speaks these APIs itself, so nothing is translated: the body is validated (``_wire``) and sent as
the client wrote it, plus the capture flags; the answer goes back as vLLM wrote it, less what the
client did not ask for (``proxy.gateway._capture.strip_response``), and a stream's chunks are relayed as
they come (``PASSTHROUGH_EVENTS``). Errors have OpenAI's shape.
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from proxy.errors import InvalidRequest, ProxyError, error_body, error_response
from proxy.gateway._call import Call
from proxy.gateway._capture import Asked, Endpoint, strip_response, without_token_fields
from proxy.gateway.dialects.chat._wire import ChatCompletionRequest, CompletionRequest

_DONE = b"data: [DONE]\n\n"


class PassthroughEvents:
    """A stream in its own API's events: each chunk as a ``data:`` event, then ``[DONE]`` (a ``StreamTranslator``)."""

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        return [b"data: " + orjson.dumps(chunk) + b"\n\n"]

    def finish(self) -> list[bytes]:
        return [_DONE]

    def failed(self, message: str) -> list[bytes]:
        return [b"data: " + orjson.dumps(error_body(message, "upstream_error", None, 502)) + b"\n\n"]

    def response(self) -> None:
        return None  # the record keeps the chunks as the capture reassembled them


PASSTHROUGH_EVENTS = PassthroughEvents()  # it holds no state: one for every stream


class Passthrough:
    """An API vLLM serves itself (a ``Dialect`` that translates nothing)."""

    asked: Asked | None = None  # what the client's own body asks for

    def __init__(self, endpoint: Endpoint, model: type[BaseModel]) -> None:
        self.endpoint: str = endpoint
        self.upstream: Endpoint = endpoint
        self._model = model

    def request(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            self._model.model_validate(body)
        except ValidationError as exc:
            raise InvalidRequest.from_validation(exc.errors()) from exc
        return body

    def answer(self, data: dict[str, Any], call: Call) -> tuple[dict[str, Any], dict[str, Any]]:
        recorded = without_token_fields(data)  # a copy: what follows strips ``data`` in place
        return recorded, strip_response(data, call.asked, call.route.public_name)

    def stream(self, body: dict[str, Any], model: str) -> PassthroughEvents:
        return PASSTHROUGH_EVENTS

    def error(self, exc: ProxyError, headers: dict[str, str] | None = None) -> Response:
        return error_response(exc, headers)


CHAT = Passthrough("chat.completions", ChatCompletionRequest)
COMPLETIONS = Passthrough("completions", CompletionRequest)
